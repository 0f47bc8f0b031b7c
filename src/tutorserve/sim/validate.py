"""Predicted against measured: replay each measured serving run (`bench compare` JSON: its
workload, seed, rate, SLOs and the server's own command line) in the simulator."""

from __future__ import annotations

import functools
import json
import logging
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from tutorserve.bench.compare import cohort_of, warmup_cohort
from tutorserve.bench.serving_metrics import SLO, RequestRecord
from tutorserve.bench.step_cost import StepCostModel
from tutorserve.models.config import ModelConfig
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.sim.setup import Deployment, relative_error
from tutorserve.sim.simulator import ClientRun, SimResult, SimSession
from tutorserve.sim.workload import serving_sessions

log = logging.getLogger(__name__)
METRICS = ("goodput", "p50_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "mean_step_ms", "prefix_hit",
           "preemptions")  # fmt: skip
_FIT_ROUNDS, _FIT_TOLERANCE_S = 8, 1e-4  # the per-step overhead settles to 0.1 ms


def _measured(summary: dict[str, float]) -> dict[str, float]:
    """The run's summary, with what the server's counters said under the simulator's names
    (NaN where the server, or a run from before the counter, does not say)."""
    return {**summary, "prefix_hit": summary.get("server_prefix_cache_hit_rate", math.nan),
            "mean_step_ms": summary.get("server_mean_step_ms", math.nan),
            "preemptions": summary.get("server_preemptions", math.nan)}  # fmt: skip


def served_before(path: Path, run: dict[str, Any]) -> list[dict[str, Any]]:
    """What the measured server served before this run, oldest first, as `bench compare`
    records it. A run recorded before it did (2026-12-07) gets what `bench compare` sent its
    server: the warm-up, then the runs of the same system and workload in the same folder
    with an earlier seed (one seed per rate, in the order of the rates)."""
    c = run["config"]
    if "served_before" in c:
        return c["served_before"]
    if "system" not in c:  # a `bench serve` run, on a server that says nothing of its past
        return []
    earlier = []
    for o in _configs_in(str(path.parent)):
        same = all(o.get(k) == c[k] for k in ("system", "workload")) and "seed" in o
        if same and o["seed"] < c["seed"]:
            earlier.append(cohort_of(o))
    return [warmup_cohort(c), *sorted(earlier, key=lambda e: e["seed"])]


@functools.cache
def _configs_in(folder: str) -> list[dict[str, Any]]:
    """The configs of the runs in `folder`, read once: validating or fitting on a folder's runs
    asks for them per run and per fitting round."""
    return [json.loads(f.read_text()).get("config", {}) for f in Path(folder).glob("*.json")]


def _sessions(tok: Tokenizer, c: dict[str, Any]) -> list[SimSession]:
    return serving_sessions(tok, c["workload"], c["num_requests"], float(c["request_rate"]),
                            burstiness=c["burstiness"], arrival=c["arrival"],
                            seed=c["seed"])  # fmt: skip


def _simulate(
    path: Path, run: dict[str, Any], cost: StepCostModel, cfg: ModelConfig, tok: Tokenizer
) -> tuple[Deployment, SimResult]:
    """The run replayed on replicas that first served what its server served before it."""
    c = run["config"]
    deployment = Deployment.from_argv(c["argv"], cfg)
    earlier = [ClientRun(_sessions(tok, e), e["max_concurrency"])
               for e in served_before(path, run)]  # fmt: skip
    simulation = deployment.simulation(cost, tok.vocab_size)
    return deployment, simulation.run(_sessions(tok, c), earlier=earlier)


def replay(path: Path, cost: StepCostModel, cfg: ModelConfig, tok: Tokenizer) -> dict[str, Any]:
    run = json.loads(path.read_text())
    c = run["config"]
    deployment, result = _simulate(path, run, cost, cfg, tok)
    predicted = result.summary(SLO(c["slo_ttft_ms"], c["slo_tpot_ms"]))
    predicted["prefix_hit"] = predicted["prefix_cache_hit_rate"]
    measured = _measured(run["summary"])
    return {
        "file": str(path),
        "system": c["system"],
        "workload": c["workload"],
        "rate": float(c["request_rate"]),
        "deployment": deployment.label(),
        "pairs": {m: (predicted.get(m), measured.get(m)) for m in METRICS},
        "predicted": predicted,
    }


def _request_pairs(
    paths: list[Path], cost: StepCostModel, cfg: ModelConfig, tok: Tokenizer
) -> list[tuple[RequestRecord, RequestRecord]]:
    """(measured, simulated) per request of every run, matched by session and turn."""
    out = []
    for path in paths:
        run = json.loads(path.read_text())
        sim = {(r.session, r.turn): r for r in _simulate(path, run, cost, cfg, tok)[1].records()}
        for raw in run["records"]:
            real = RequestRecord(**raw)
            twin = sim.get((real.session, real.turn))
            if real.ok and twin is not None and twin.ok:
                out.append((real, twin))
    return out


def fit_serving(
    paths: list[Path], cost: StepCostModel, cfg: ModelConfig, tok: Tokenizer
) -> StepCostModel:
    """`cost` with the serving path's additions fitted on measured runs: the per-step overhead is
    moved by the median of measured less simulated TPOT, request by request (one step per output
    token), until it settles; then, with it, the request overhead is the median of measured less
    simulated TTFT. Medians, so that a few requests caught in a queue (where the two disagree
    most) do not decide. Settling, because longer steps batch more requests together, which
    lengthens the steps again: the first gap overshoots (by 8 % in the test's known case)."""
    if not paths:
        raise ValueError("give at least one measured run to fit the serving overheads on")
    model = replace(cost, request_overhead_s=0.0, serving_step_overhead_s=0.0)
    for _ in range(_FIT_ROUNDS):
        pairs = _request_pairs(paths, model, cfg, tok)
        gaps = [real.tpot - sim.tpot for real, sim in pairs if real.tpot and sim.tpot]
        if not gaps:
            raise ValueError("no request in these runs has a TPOT to fit on")
        # Not below 0: serving cannot make a step faster than the engine alone.
        step = max(0.0, model.serving_step_overhead_s + statistics.median(gaps))
        moved = abs(step - model.serving_step_overhead_s)
        model = replace(model, serving_step_overhead_s=step)
        if moved < _FIT_TOLERANCE_S:
            break
    else:
        log.warning("the per-step overhead still moved %.1f ms in the last round", moved * 1000)
    pairs = _request_pairs(paths, model, cfg, tok)
    model.request_overhead_s = max(0.0, statistics.median(r.ttft - s.ttft for r, s in pairs))
    model.meta = {**model.meta, "serving_fit_runs": [p.name for p in paths]}
    return model


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| run (measured JSON) | req/s | "
        + " | ".join(f"{m} sim / real (err)" for m in METRICS)
        + " |"
    )
    lines = [head, "|" + "---|" * (2 + len(METRICS))]
    for r in rows:
        cells = []
        for m in METRICS:
            p, q = r["pairs"][m]
            fmt = "{:.0%}" if m == "prefix_hit" else "{:.3g}"
            cells.append(f"{fmt.format(p)} / {fmt.format(q)} ({relative_error(p, q):+.0%})")
        run = Path(r["file"]).stem
        lines.append(f"| {run} | {r['rate']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def within(rows: list[dict[str, Any]], tolerance: float, metrics: tuple[str, ...]) -> str:
    """How many pairs of `metrics` lie within `tolerance`."""
    errs = [abs(relative_error(*r["pairs"][m])) for r in rows for m in metrics]
    ok = sum(e <= tolerance for e in errs)
    return f"{ok} of {len(errs)} pairs of {', '.join(metrics)} within {tolerance:.0%}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ("goodput", "p50_ttft_ms", "p90_ttft_ms")
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 4))
    for ax, m in zip(axes, shown, strict=True):
        for r in rows:
            p, q = r["pairs"][m]
            ax.scatter(q, p, label=f"{r['system']} {r['workload']} @{r['rate']:g}", s=18)
        values = [v for r in rows for v in r["pairs"][m] if v == v and v is not None]
        lo, hi = min(values), max(values)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], alpha=0.15)
        ax.set(xlabel=f"measured {m}", ylabel=f"simulated {m}", title=m)
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
