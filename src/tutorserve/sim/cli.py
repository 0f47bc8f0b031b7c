"""`tutorserve sim ...` (replay workloads, validate against measured runs) and `tutorserve plan`."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tutorserve.bench.cli import provenance
from tutorserve.bench.serving_metrics import SLO
from tutorserve.bench.step_cost import HARDWARE, ModelCosts, StepCostModel
from tutorserve.bench.workloads import WORKLOADS
from tutorserve.cluster.routing import POLICIES as ROUTING
from tutorserve.models.registry import DEFAULT_MODEL

# A served model's fixed per-step cost on a GPU (kernel launches, scheduling, sampling), used
# only with --hardware NAME; an assumption, printed with every plan that uses it.
_GPU_STEP_OVERHEAD_S = 0.004
_GPU_MEMORY_FOR_KV = 0.9  # of what the weights leave (activations and allocator slack: the rest)


def add_sim_parser(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("sim", help="the cluster simulator").add_subparsers(
        dest="sim", required=True
    )
    p = sim.add_parser("validate", help="replay measured `bench compare` runs; predicted vs real")
    p.add_argument("measured", nargs="+", help="bench result JSON files")
    p.add_argument("--step-cost", required=True, help="a `bench calibrate` step-cost.json")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", default="bench-results/sim", help="folder for JSON and PNG")
    p.set_defaults(func=cmd_validate)

    p = sim.add_parser("fit-serving", help="fit what serving adds to engine steps, on runs")
    p.add_argument("measured", nargs="+", help="bench result JSON files")
    p.add_argument("--step-cost", required=True, help="a `bench calibrate` step-cost.json")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", required=True, help="the step-cost JSON to write")
    p.set_defaults(func=cmd_fit_serving)

    p = sim.add_parser("run", help="a serving workload on simulated replicas")
    _hardware_args(p)
    p.add_argument("--workload", choices=WORKLOADS, default="edu-shared-prefix")
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--request-rates", default="0.5,1,2", help="comma-separated, per second")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--routing", choices=list(ROUTING), default="cache-aware")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("plan", help="replicas and cost for a district's evening peak")
    _hardware_args(p)
    p.add_argument("--students", required=True, help="comma-separated: one plan per count")
    p.add_argument(
        "--peak-fraction",
        type=float,
        default=0.3,
        help="share of students in a session at the peak",
    )
    p.add_argument("--price-per-hour", type=float, help="one replica's machine, per hour")
    p.add_argument(
        "--attainment", type=float, default=0.9, help="share of turns that must meet the SLOs"
    )
    p.add_argument("--courses", type=int, default=40)
    p.add_argument("--sim-replicas", type=int, default=2, help="replicas simulated per search")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/plan", help="folder for JSON and PNG")
    p.set_defaults(func=cmd_plan)


def _hardware_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--hardware", default="bench-results/calibrate/step-cost.json",
                   help=f"a `bench calibrate` step-cost.json, or one of {', '.join(HARDWARE)} "
                        "(datasheet numbers, not measured)")  # fmt: skip
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        help="KV pool per replica (default: 1 on a host, what a GPU's memory leaves)",
    )
    p.add_argument("--ram-tier-gb", type=float, default=8.0,
                   help="host-RAM KV tier per replica, for policies with one")  # fmt: skip
    p.add_argument(
        "--pd-link-gbs",
        type=float,
        default=25.0,
        help="KV transfer rate between prefill and decode replicas (P/D splits)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--slo-ttft-ms", type=float, default=3000)
    p.add_argument("--slo-tpot-ms", type=float, default=250)


def _cost_and_kv(a: argparse.Namespace, cfg: Any) -> tuple[StepCostModel, float, str]:
    """The step-cost model, the KV GiB per replica, and a line saying where both come from."""
    if a.hardware in HARDWARE:
        hw = HARDWARE[a.hardware]
        costs = ModelCosts.of(cfg)
        cost = StepCostModel.from_hardware(hw, costs, _GPU_STEP_OVERHEAD_S)
        free = (hw.mem_gib - costs.weight_bytes / (1 << 30)) * _GPU_MEMORY_FOR_KV
        kv = a.kv_cache_gb or free
        return cost, kv, (f"{cost.source}; step overhead {_GPU_STEP_OVERHEAD_S * 1000:g} ms "
                          f"assumed; KV {kv:.1f} GiB per replica")  # fmt: skip
    if not Path(a.hardware).is_file():
        raise FileNotFoundError(
            f"{a.hardware}: no step-cost model there (run `tutorserve bench "
            f"calibrate`) and not a hardware name ({', '.join(HARDWARE)})"
        )
    cost = StepCostModel.load(a.hardware)
    kv = a.kv_cache_gb or 1.0
    return cost, kv, (f"measured: {cost.source}, {cost.meta.get('threads') or 'all'} threads, "
                      f"{cost.meta.get('date')}; KV {kv:g} GiB per replica")  # fmt: skip


def cmd_validate(a: argparse.Namespace) -> int:
    from tutorserve.models.loader import load_model_config, load_tokenizer
    from tutorserve.sim.validate import plot, replay, table, within

    cost = StepCostModel.load(a.step_cost)
    cfg, tok = load_model_config(a.model), load_tokenizer(a.model)
    rows = [replay(Path(f), cost, cfg, tok) for f in a.measured]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "validate.png")
    print(table(rows))
    print(within(rows, 0.15, ("goodput", "p50_ttft_ms", "p90_ttft_ms")))
    print()
    provenance(f"step cost: {cost.source} ({a.step_cost})")
    return 0


def cmd_fit_serving(a: argparse.Namespace) -> int:
    from tutorserve.models.loader import load_model_config, load_tokenizer
    from tutorserve.sim.validate import fit_serving

    cost = StepCostModel.load(a.step_cost)
    cfg, tok = load_model_config(a.model), load_tokenizer(a.model)
    model = fit_serving([Path(f) for f in a.measured], cost, cfg, tok)
    model.save(a.out)
    print(f"serving step overhead {model.serving_step_overhead_s * 1000:.1f} ms; request overhead "
          f"{model.request_overhead_s * 1000:.0f} ms → {a.out}")  # fmt: skip
    print()
    provenance(f"fitted on {len(a.measured)} runs")
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from tutorserve.models.loader import load_model_config, load_tokenizer
    from tutorserve.sim.setup import Deployment
    from tutorserve.sim.workload import serving_sessions

    cfg, tok = load_model_config(a.model), load_tokenizer(a.model)
    cost, kv, source = _cost_and_kv(a, cfg)
    d = Deployment.of(cfg, cost.meta.get("dtype", "auto"), kv, a.replicas, a.routing,
                      a.ram_tier_gb,
                      max_num_seqs=a.max_num_seqs,
                      max_num_batched_tokens=a.max_num_batched_tokens)  # fmt: skip
    slo = SLO(a.slo_ttft_ms, a.slo_tpot_ms)
    print("| req/s | goodput | TTFT p50 / p90 ms | TPOT mean ms | prefix hits | preemptions |"
          "\n|---|---|---|---|---|---|")  # fmt: skip
    for k, rate in enumerate(float(r) for r in a.request_rates.split(",")):
        sessions = serving_sessions(tok, a.workload, a.num_requests, rate, seed=a.seed + k)
        s = d.simulation(cost, tok.vocab_size).run(sessions).summary(slo)
        print(f"| {rate:g} | {s['goodput']:.2f} | {s['p50_ttft_ms']:.0f} / "
              f"{s['p90_ttft_ms']:.0f} | {s['mean_tpot_ms']:.0f} | "
              f"{s['prefix_cache_hit_rate']:.0%} | {s['preemptions']} |")  # fmt: skip
    print()
    provenance(f"{d.label()}; {source}")
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from tutorserve.models.loader import load_model_config
    from tutorserve.sim.planner import Planner, kv_wall
    from tutorserve.sim.setup import GIB, Deployment
    from tutorserve.sim.workload import Cohort

    if not 0 < a.attainment <= 1 or a.sim_replicas < 1 or a.courses < 1:
        raise ValueError("need --attainment in (0, 1], --sim-replicas >= 1 and --courses >= 1")
    cfg = load_model_config(a.model)
    cost, kv, source = _cost_and_kv(a, cfg)
    dtype = cost.meta.get("dtype", "auto")
    cohort = Cohort(courses=a.courses)
    d = Deployment.of(cfg, dtype, kv, a.sim_replicas, ram_tier_gb=a.ram_tier_gb,
                      link_gbs=a.pd_link_gbs,
                      max_num_seqs=a.max_num_seqs,
                      max_num_batched_tokens=a.max_num_batched_tokens)  # fmt: skip
    planner = Planner(cost, d, cohort, cfg.vocab_size, SLO(a.slo_ttft_ms, a.slo_tpot_ms),
                      a.attainment, a.seed)  # fmt: skip
    students = [int(n) for n in a.students.split(",")]
    plans = planner.plan(students, a.peak_fraction, a.price_per_hour)
    wall = kv_wall(cfg, kv * GIB, dtype, cohort)
    print(
        f"peak: {a.peak_fraction:.0%} of students in a session, each sending a message every "
        f"{cohort.turn_interval_s():g} s"
    )
    print(
        f"KV wall per replica: {wall['formula']} = {wall['kv_bytes_per_token_terms']} = "
        f"{wall['kv_bytes_per_token']:,} B; {wall['kv_budget_gib']:.1f} GiB holds "
        f"{wall['kv_tokens']:,} tokens = {wall['sessions_without_sharing']} sessions of "
        f"{wall['mean_session_tokens']:.0f} tokens each with its own course prompt; sharing "
        f"one copy per course: {wall['sessions_sharing_one_course']} if the replica serves "
        f"one course, {wall['sessions_sharing_all_courses']} if it serves all {a.courses}"
    )
    print(
        "\n| students | turns/s at peak | policy | turns/s per replica | replicas | "
        "cost per 1,000 turns | TTFT p90 ms at capacity |\n|---|---|---|---|---|---|---|"
    )
    for p in sorted(plans, key=lambda p: p.students):
        price = "—" if p.cost_per_1000_turns is None else f"{p.cost_per_1000_turns:.3f}"
        print(
            f"| {p.students:,} | {p.demand_turns_per_s:,.1f} | {p.policy} | "
            f"{p.turns_per_s_per_replica:.2f} | {p.replicas:,} | {price} | "
            f"{p.at_capacity.get('p90_ttft_ms', math.nan):.0f} |"
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"plan-{a.hardware if a.hardware in HARDWARE else 'host'}"
    (out / f"{name}.json").write_text(json.dumps({
        "peak_fraction": a.peak_fraction,
        "cohort": asdict(cohort), "kv_wall": wall, "source": source,
        "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms}, "attainment": a.attainment,
        "plans": [asdict(p) for p in plans],
    }, indent=1))  # fmt: skip
    _plot_plan(plans, out / f"{name}.png")
    print()
    provenance(source)
    return 0


def _plot_plan(plans: list[Any], path: Path) -> None:
    """Replicas needed per policy, one group of bars per district size (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({p.students for p in plans})
    policies = list(dict.fromkeys(p.policy for p in plans))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(policies)
    for k, policy in enumerate(policies):
        counts = [next(p.replicas for p in plans if p.policy == policy and p.students == n)
                  for n in sizes]  # fmt: skip
        ax.bar([i + k * width for i in range(len(sizes))], counts, width, label=policy)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))],
                  [f"{n:,} students" for n in sizes])  # fmt: skip
    ax.set(yscale="log", ylabel="replicas needed", title="replicas at the evening peak")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
