"""`tutorserve bench tutor-scale`: runs `tutor_scale` and prints its tables:
tokens and latency per feature set against the baseline, tokens by tier, and latency under a
failing large model against the healthy one; a plot of tokens and latency per feature set."""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tutorserve.bench.modelled_endpoints import LARGE, SMALL
from tutorserve.bench.tutor_scale import (
    Features,
    Result,
    run_engine_bench,
    run_scale_bench,
)


def table(results: list[Result]) -> str:
    rows = [
        "| students / course | features | turns | solved | model tokens / turn "
        "| model tokens / solved problem | vs baseline | reply-cache hit rate "
        "| model tokens per 1,000 turns | model seconds per 1,000 turns | p50 / p90 turn ms "
        "| ladder as baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r.students: r for r in results if r.features == Features()}
    for r in results:
        b = base.get(r.students)
        per_solved = r.tokens / max(1, r.solved)
        vs = f"{per_solved / (b.tokens / max(1, b.solved)) - 1:+.0%}" if b else "–"
        hit = f"{r.cache_hits / r.cache_lookups:.0%}" if r.cache_lookups else "–"
        same = "yes" if b and [x[2] for x in r.ladder] == [x[2] for x in b.ladder] else "no"
        rows.append(
            f"| {r.students} | {r.features.label} | {r.turns} | {r.solved} | "
            f"{r.tokens / r.turns:.0f} | {per_solved:.0f} | {vs} | {hit} | "
            f"{1000 * r.tokens / r.turns:,.0f} | {1000 * r.model_seconds / r.turns:,.0f} | "
            f"{r.p(0.5):.0f} / {r.p(0.9):.0f} | {same} |"
        )
    return "\n".join(rows)


def tier_table(results: list[Result]) -> str:
    rows = [
        "| students / course | features | tokens by tier | breaker opened "
        "| calls hedged (hedge first) | replies a model wrote |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        tiers = ", ".join(f"{k}: {v:,}" for k, v in sorted(r.by_tier.items()))
        rows.append(f"| {r.students} | {r.features.label} | {tiers} | {r.breaker_opened} | "
                    f"{r.hedged} ({r.hedges_won}) | {r.model_replies} of {r.turns} |")  # fmt: skip
    return "\n".join(rows)


def degradation(results: list[Result]) -> str:
    healthy = [r for r in results if not r.features.large_hangs and r.features.tiering]
    failing = [r for r in results if r.features.large_hangs]
    out = []
    for f in failing:
        h = next((x for x in healthy if x.students == f.students
                  and x.features.cache == f.features.cache), None)  # fmt: skip
        if h:
            out.append(
                f"{f.features.label}, {f.students} students per course: p90 {f.p(0.9):.0f} ms ="
                f" {f.p(0.9) / h.p(0.9):.2f}× healthy p90 {h.p(0.9):.0f} ms (median"
                f" {statistics.median(f.latency_ms):.0f} ms); after each student's first"
                f" problem: p90 {f.p(0.9, True):.0f} ms = {f.p(0.9, True) / h.p(0.9, True):.2f}×"
                f" healthy {h.p(0.9, True):.0f} ms"
            )
    return "\n".join(out)


def plot(results: list[Result], path: Path) -> None:
    """Per class size: model tokens per solved problem, and p50/p90 turn latency, per feature
    set (the baseline first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.students for r in results})
    fig, axes = plt.subplots(len(sizes), 2, figsize=(12, 3.2 * len(sizes)), squeeze=False)
    for row, n in zip(axes, sizes, strict=True):
        runs = [r for r in results if r.students == n]
        labels = [r.features.label for r in runs]
        y = range(len(runs))
        row[0].barh(y, [r.tokens / max(1, r.solved) for r in runs], color="tab:blue")
        row[0].set(yticks=list(y), yticklabels=labels, xlabel="model tokens per solved problem",
                   title=f"{n} students per course")  # fmt: skip
        row[1].barh([i + 0.2 for i in y], [r.p(0.9) / 1000 for r in runs], 0.4, label="p90")
        row[1].barh([i - 0.2 for i in y], [r.p(0.5) / 1000 for r in runs], 0.4, label="p50")
        row[1].set(yticks=list(y), yticklabels=[], xlabel="turn latency, s")
        row[1].legend()
        for ax in row:
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def as_json(results: list[Result]) -> dict[str, Any]:
    return {
        "endpoints": {"small": asdict(SMALL), "large": asdict(LARGE)},
        "runs": [
            {**asdict(r), "features": asdict(r.features), "label": r.features.label}
            for r in results
        ],
    }


def run_report(
    students: list[int], problems: int, out: Path, engine: str | None, engine_students: int
) -> None:
    """`bench tutor-scale`: the simulated-endpoint runs per class size, and optionally the same
    on one model of our engine in process; JSON in `out`, tables printed."""
    logging.getLogger("tutorserve.tutor").setLevel(logging.ERROR)  # expected fallbacks
    out.mkdir(parents=True, exist_ok=True)
    if students:
        results = run_scale_bench(students, problems)
        (out / "tutor-scale.json").write_text(json.dumps(as_json(results), indent=1))
        plot(results, out / "tutor-scale.png")
        print(table(results))
        print()
        print(tier_table(results))
        print()
        print(degradation(results))
    if engine:
        real = run_engine_bench(engine, engine_students, problems)
        (out / "tutor-scale-engine.json").write_text(json.dumps(as_json(real), indent=1))
        plot(real, out / "tutor-scale-engine.png")
        print(f"\non the engine ({engine}), both tiers one model:")
        print(table(real))
        print()
        print(tier_table(real))
