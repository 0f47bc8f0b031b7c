"""The `tutorserve` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tutorserve.cluster.routing import POLICIES as ROUTING_POLICIES
from tutorserve.cluster.scaling import Scale, add_scaling_args, scale_from_args
from tutorserve.config import add_engine_args, engine_options
from tutorserve.engine.policy import POLICIES
from tutorserve.models.classes import MODEL_CLASSES
from tutorserve.models.registry import DEFAULT_MODEL
from tutorserve.sampling_params import SamplingParams
from tutorserve.spec import SpeculativeChoices

log = logging.getLogger("tutorserve")
# known above the config layer only
ENGINE_CHOICES = {"scheduling": list(POLICIES), "speculative": SpeculativeChoices()}


def add_tutor_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tutor")
    g.add_argument("--no-tutor", action="store_true", help="serve only the OpenAI API and chat")
    g.add_argument(
        "--courses",
        action="append",
        default=[],
        metavar="DIR",
        help="a course folder, or a folder of them, besides the built-in ones (repeatable)",
    )
    g.add_argument(
        "--tutor-db",
        default=None,
        metavar="URL",
        help="SQLAlchemy URL for learners and sessions (default: SQLite under "
        "$TUTORSERVE_DATA_DIR or ~/.local/share/tutorserve; postgresql+psycopg://... works)",
    )
    g.add_argument(
        "--tutor-llm-url",
        default=None,
        metavar="URL",
        help="OpenAI-compatible base URL (…/v1) for the tutor's agents; default: this engine",
    )
    g.add_argument("--tutor-llm-model", default=None, help="model name at --tutor-llm-url")
    g.add_argument("--tutor-llm-key", default=None, help="API key for --tutor-llm-url")
    g.add_argument(
        "--tutor-config",
        default=None,
        metavar="YAML",
        help="the tutor's models by tier, tiering policy, reply cache, breakers and per-school "
        "quotas (docs/tutor-config.md); default: this engine for every agent, none of the rest",
    )
    g.add_argument(
        "--otel",
        default="off",
        choices=["off", "console", "otlp"],
        help="OpenTelemetry spans per tutor agent",
    )
    g.add_argument("--otel-endpoint", default=None, help="OTLP/HTTP endpoint (…/v1/traces)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.sample_seed,
        stop=a.stop,
    )


def cmd_models(_: argparse.Namespace) -> int:
    from tutorserve.models.registry import list_models

    for name, where in list_models():
        print(f"{name}\t{where}")
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from tutorserve import LLM

    params = sampling_params(a)
    llm = LLM(**engine_options(a))
    prompt = a.prompt
    if not a.raw and llm.tokenizer.chat_template:
        prompt = llm.render_chat([{"role": "user", "content": a.prompt}])
    for piece in llm.stream(prompt, params, lora=a.adapter):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from tutorserve import LLM

    params = sampling_params(a)
    llm = LLM(**engine_options(a))
    messages: list[dict[str, str]] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print("tutorserve chat — type a message, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        sys.stdout.write("tutor> ")
        reply = []
        for piece in llm.stream(llm.render_chat(messages), params):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from tutorserve.config import EngineConfig
    from tutorserve.engine.async_engine import AsyncEngine
    from tutorserve.engine.engine import LLMEngine
    from tutorserve.server.app import ServerSettings, build_app

    if a.max_waiting < 1 or (a.max_requests_per_user is not None and a.max_requests_per_user < 1):
        raise ValueError("--max-waiting and --max-requests-per-user must be at least 1")
    if not 0 <= a.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    api_key = a.api_key or os.environ.get("TUTORSERVE_API_KEY") or None
    scale = scale_from_args(a, batch=a.max_num_seqs)
    make_tutor = _tutor_service(a)
    config = EngineConfig.from_kwargs(**engine_options(a))
    if scale is not None:
        server = _cluster_front(a, config, scale)
    else:
        server = AsyncEngine(
            lambda: LLMEngine(config),
            max_waiting=a.max_waiting,
            max_requests_per_user=a.max_requests_per_user,
        )
    settings = ServerSettings(
        model_name=a.served_model_name or a.model,
        api_key=api_key,
        allowed_origins=a.allowed_origins,
        max_body_bytes=a.max_body_bytes,
    )
    tutor = make_tutor(server, settings.model_name) if make_tutor else None
    app = build_app(server, settings, tutor)
    host = f"[{a.host}]" if ":" in a.host else a.host
    log.info(
        "serving %s at http://%s:%d/ (tutor page; OpenAI API under /v1)%s",
        settings.model_name,
        host,
        a.port,
        " — API key required" if api_key else "",
    )
    uvicorn.run(app, host=a.host, port=a.port, log_level="info" if a.verbose else "warning")
    return 0


def _cluster_front(a: argparse.Namespace, config: Any, scale: Scale) -> Any:
    """The engines on Ray Serve, and their front for the server. Each replica gets its share
    of this host's threads (with the most replicas it may have) unless told, and of the disk
    tier's budget: the replicas share its folder, so a session outlives the replica that
    served it (and a prefilled prompt's blocks reach the decode replica)."""
    from tutorserve.cluster.disagg import DisaggFront
    from tutorserve.cluster.front import ClusterFront
    from tutorserve.cluster.launch import start_replicas
    from tutorserve.models.loader import load_tokenizer

    options = engine_options(a)
    # Ray workers do not start in this process's working directory.
    options["kv_disk_dir"] = str(Path(options["kv_disk_dir"]).expanduser().resolve())
    options["kv_disk_bytes"] //= scale.most_engines
    if not options.get("num_threads"):
        options["num_threads"] = max(1, (os.cpu_count() or 1) // scale.most_engines)
    replicas = start_replicas(options, scale=scale, routing=a.routing,
                              ray_address=a.ray_address,
                              cpus_per_replica=a.cpus_per_replica)  # fmt: skip
    try:
        front = dict(tokenizer=load_tokenizer(config.model), adapters=replicas.adapters,
                     block_size=config.block_size, max_waiting=a.max_waiting,
                     max_requests_per_user=a.max_requests_per_user,
                     shutdown=replicas.stop)  # fmt: skip
        if replicas.prefill is not None:
            return DisaggFront(replicas.handle, replicas.prefill, **front)
        return ClusterFront(replicas.handle, **front)
    except BaseException:
        replicas.stop()  # no Ray processes outlive a failed start
        raise


def _tutor_service(a: argparse.Namespace) -> Callable[[Any, str], Any] | None:
    """Courses, store, tracing and the tutor config are checked before the model loads (a typo
    in --courses should not cost a model load); the service itself needs the engine, so it
    comes back as a function of it."""
    if a.no_tutor:
        return None
    from tutorserve.tutor.courses import load_courses
    from tutorserve.tutor.service import TutorService
    from tutorserve.tutor.settings import TutorSettings
    from tutorserve.tutor.store import TutorStore
    from tutorserve.tutor.tracing import setup_tracing

    if a.tutor_config and a.tutor_llm_url:
        raise ValueError("--tutor-llm-url is --tutor-config's one-model case: give one of them")
    if a.tutor_config:
        settings = TutorSettings.load(a.tutor_config)
    elif a.tutor_llm_url:
        settings = TutorSettings.one_endpoint(a.tutor_llm_url, a.tutor_llm_model, a.tutor_llm_key)
    else:
        settings = TutorSettings.plain()
    courses = load_courses(a.courses)
    store = TutorStore(a.tutor_db)
    setup_tracing(a.otel, a.otel_endpoint)

    def build(server: Any, model_name: str) -> TutorService:
        engines = settings.second_engines()
        routing = settings.routing(server, model_name, engines)
        log.info("tutor: %d courses (%s); models by tier: %s; policy %s", len(courses),
                 ", ".join(courses), routing.describe(), routing.policy.name)  # fmt: skip
        return TutorService(courses, store, routing, quotas=settings.quota_book(),
                            engines=engines.values())  # fmt: skip

    return build


def cmd_synth_model(a: argparse.Namespace) -> int:
    from tutorserve.models.synth import SynthSpec, synth_model

    spec = SynthSpec(
        arch=a.arch,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
        intermediate=a.intermediate,
        vocab=a.vocab,
        max_position_embeddings=a.max_position,
        tie_word_embeddings=a.tie_embeddings,
        seed=a.seed,
    )
    out = synth_model(a.out, spec)
    print(f"wrote {spec.arch} checkpoint to {out}")
    return 0


def cmd_synth_lora(a: argparse.Namespace) -> int:
    from tutorserve.lora.synth import synth_lora
    from tutorserve.models.loader import load_model_config

    targets = tuple(t.strip() for t in a.targets.split(",") if t.strip())
    base = load_model_config(a.base)
    out = synth_lora(a.out, base, a.rank, targets, a.alpha, a.seed, a.base, a.strength)
    print(f"wrote a rank-{a.rank} LoRA adapter for {a.base} ({', '.join(targets)}) to {out}")
    return 0


def cmd_check_course(a: argparse.Namespace) -> int:
    from tutorserve.tutor.courses import load_course

    for folder in a.folders:
        c = load_course(folder)
        cefr = sorted({k.cefr for k in c.kcs if k.cefr})
        print(
            f"{folder}: course {c.id!r} ({c.subject}) is valid: {len(c.kcs)} KCs, "
            f"{len(c.problems)} problems" + (f", CEFR levels {', '.join(cefr)}" if cefr else "")
        )
    return 0


def cmd_plot_learner(a: argparse.Namespace) -> int:
    from tutorserve.tutor.report import learner_traces, plot_traces, traces_table
    from tutorserve.tutor.store import TutorStore

    store = TutorStore(a.tutor_db)
    try:
        traces = learner_traces(store, a.learner)
    finally:
        store.close()
    out = Path(a.out or f"{a.learner}-mastery.png")
    plot_traces(traces, a.learner, out)
    print(traces_table(traces))
    print(f"plot: {out}")
    return 0


def cmd_costs(a: argparse.Namespace) -> int:
    from tutorserve.tutor.cost_report import costs_table, plot_costs
    from tutorserve.tutor.store import TutorStore
    from tutorserve.tutor.usage_store import UsageStore

    store = TutorStore(a.tutor_db)
    try:
        totals = UsageStore(store).totals(a.by)
    finally:
        store.close()
    print(costs_table(totals, a.by))
    if totals:
        out = Path(a.out or f"tutor-costs-by-{a.by}.png")
        plot_costs(totals, a.by, out)
        print(f"plot: {out}")
    return 0


def cmd_fit_bkt(a: argparse.Namespace) -> int:
    from tutorserve.tutor.fit import fit_and_report

    print(fit_and_report(a.data, a.out, a.test_fraction, a.iterations, a.forgetting, a.seed))
    return 0


def cmd_fit_kt(a: argparse.Namespace) -> int:
    from tutorserve.tutor.fit import fit_kt_and_report, write_split
    from tutorserve.tutor.kt import DKTConfig

    if a.split and a.test:
        raise ValueError("--split makes the train and test logs; give it without --test")
    if a.split:
        print(write_split(a.split, a.out, a.test_fraction, a.seed))
        return 0
    if not (a.train and a.test):
        raise ValueError("give --train and --test (or --split LOG to make them from one log)")
    dkt = DKTConfig(hidden=a.hidden, epochs=a.epochs, seed=a.seed, threads=a.threads)
    print(fit_kt_and_report(a.train, a.test, a.out, a.model, a.iterations, dkt))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tutorserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("models", help="list the model names we resolve offline").set_defaults(
        func=cmd_models
    )

    p = sub.add_parser("generate", help="complete one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="skip the chat template")
    p.add_argument("--adapter", default=None, help="a LoRA adapter given with --lora to apply")
    add_engine_args(p, choices=ENGINE_CHOICES)
    add_sampling_args(p, max_tokens=256)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="terminal chat, streaming tokens as they come")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_args(p, choices=ENGINE_CHOICES)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a tutor page at /")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key", default=None, help="require Bearer KEY on /v1/* (or TUTORSERVE_API_KEY)"
    )
    p.add_argument("--served-model-name", default=None, help="model id clients send")
    p.add_argument("--max-waiting", type=int, default=256, help="waiting-queue cap; beyond it, 429")
    p.add_argument(
        "--max-requests-per-user",
        type=int,
        default=None,
        help="concurrent requests one `user` may have; beyond it, 429",
    )
    p.add_argument(
        "--allowed-origins", nargs="*", default=[], help="CORS origins (none unless given)"
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger bodies get 413")
    g = p.add_argument_group("cluster (engine replicas on Ray Serve)")
    add_scaling_args(g)
    g.add_argument(
        "--routing",
        default="cache-aware",
        choices=list(ROUTING_POLICIES),
        help="which replica serves a request",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (or RAY_ADDRESS); default: a local one",
    )
    g.add_argument(
        "--cpus-per-replica",
        type=float,
        default=None,
        help="Ray CPUs each replica reserves (default: this host's cores / replicas)",
    )
    add_engine_args(p, choices=ENGINE_CHOICES)
    add_tutor_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("synth-model", help="write a random-init HF checkpoint + tokenizer")
    p.add_argument("out")
    p.add_argument("--arch", default="llama", choices=sorted(MODEL_CLASSES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=0)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--max-position", type=int, default=2048)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_synth_model)

    p = sub.add_parser("synth-lora", help="write a random PEFT LoRA adapter for a base model")
    p.add_argument("out")
    p.add_argument("--base", default=DEFAULT_MODEL, help="the base model the adapter fits")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated")
    p.add_argument("--alpha", type=float, default=None, help="default: 2 × rank")
    p.add_argument("--strength", type=float, default=0.5, help="update size relative to input")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_synth_lora)

    tutor = sub.add_parser("tutor", help="the tutoring layer").add_subparsers(
        dest="tutor", required=True
    )
    p = tutor.add_parser("check-course", help="validate course folders (as the server would)")
    p.add_argument("folders", nargs="+", metavar="DIR")
    p.set_defaults(func=cmd_check_course)

    p = tutor.add_parser(
        "plot-learner", help="a learner's mastery per KC over time, from the store"
    )
    p.add_argument("learner")
    p.add_argument("--tutor-db", default=None, metavar="URL", help="as for serve")
    p.add_argument("--out", default=None, help="PNG path (default: LEARNER-mastery.png)")
    p.set_defaults(func=cmd_plot_learner)

    from tutorserve.tutor.costs import DIMENSIONS as COST_BY

    p = tutor.add_parser("costs", help="model tokens and seconds by school, course, agent, ...")
    p.add_argument("--by", choices=COST_BY, default="school")
    p.add_argument("--tutor-db", default=None, metavar="URL", help="as for serve")
    p.add_argument("--out", default=None, help="PNG path (default: tutor-costs-by-BY.png)")
    p.set_defaults(func=cmd_costs)

    p = tutor.add_parser("fit-bkt", help="fit BKT by EM on answer logs; AUC/RMSE on held-out users")
    p.add_argument(
        "--data",
        default=str(
            Path(__file__).resolve().parents[3]
            / "shared/data/assistments/builder_train_preprocessed.csv"
        ),
        help="CSV with user_id, skill_name, correct (default: ../shared's ASSISTments export)",
    )
    p.add_argument("--test-fraction", type=float, default=0.2, help="users held out")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--forgetting", action="store_true", help="also fit a forget probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/bkt", help="folder for JSON and PNG")
    p.set_defaults(func=cmd_fit_bkt)

    p = tutor.add_parser(
        "fit-kt", help="train learner models on one answer log, AUC/RMSE on another's students"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--train", metavar="CSV", help="answer log to train on")
    g.add_argument(
        "--split",
        metavar="CSV",
        help="instead: split this log by user as fit-bkt does and write OUT/train.csv, "
        "OUT/test.csv",
    )
    p.add_argument(
        "--test",
        metavar="CSV",
        help="answer log of held-out students (user_id, skill_name, correct)",
    )
    p.add_argument(
        "--model",
        nargs="+",
        choices=["bkt", "dkt"],
        default=["bkt", "dkt"],
        help="models to train and score (default: both)",
    )
    p.add_argument("--iterations", type=int, default=30, help="BKT EM iterations")
    p.add_argument("--epochs", type=int, default=20, help="DKT epochs (the best is kept)")
    p.add_argument("--hidden", type=int, default=64, help="DKT state size")
    p.add_argument("--threads", type=int, default=1, help="torch threads for DKT")
    p.add_argument("--test-fraction", type=float, default=0.2, help="users held out by --split")
    p.add_argument("--seed", type=int, default=0, help="for --split and DKT")
    p.add_argument("--out", default="bench-results/kt", help="folder for JSON and PNG")
    p.set_defaults(func=cmd_fit_kt)

    from tutorserve.bench.cli import add_bench_parser
    from tutorserve.sim.cli import add_sim_parser

    add_bench_parser(sub)
    add_sim_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
