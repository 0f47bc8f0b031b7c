"""Tables and plots for benchmark results."""

from __future__ import annotations

import statistics
from pathlib import Path

from tutorserve.bench.offline import SystemResult


def median_run(runs: list[SystemResult]) -> SystemResult:
    """The repeat with the median throughput (an actual run, not a blend of several)."""
    ordered = sorted(runs, key=lambda r: r.output_tps)
    return ordered[(len(ordered) - 1) // 2]


def markdown_table(systems: dict[str, list[SystemResult]]) -> str:
    rows = [
        "| system | output tok/s (median, range) | TTFT mean s | TTFT p50 s | TTFT p90 s "
        "| TPOT mean ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in systems.items():
        m = median_run(runs).summary()
        tps = [r.output_tps for r in runs]
        rows.append(
            f"| {name} | {m['output_tok_s']:.1f} ({min(tps):.1f}–{max(tps):.1f}) "
            f"| {m['ttft_mean_s']:.2f} | {m['ttft_p50_s']:.2f} | {m['ttft_p90_s']:.2f} "
            f"| {m['tpot_mean_ms']:.1f} |"
        )
    return "\n".join(rows)


def plot(systems: dict[str, list[SystemResult]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(systems)
    meds = [median_run(systems[n]) for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    tps = [m.output_tps for m in meds]
    lo = [m - min(r.output_tps for r in systems[n]) for n, m in zip(names, tps, strict=True)]
    hi = [max(r.output_tps for r in systems[n]) - m for n, m in zip(names, tps, strict=True)]
    ax1.barh(names, tps, xerr=[lo, hi], color="#4c72b0")
    ax1.set_xlabel("output tokens/s (median of repeats, range as error bar)")
    ax1.invert_yaxis()
    for m, name in zip(meds, names, strict=True):
        xs = sorted(m.ttft_s)
        ax2.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax2.set_xlabel("TTFT (s)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("TTFT CDF (median run)")
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else "n/a"


def mean_extra(runs: list[SystemResult], key: str) -> float | None:
    vals = [r.extra[key] for r in runs if r.extra.get(key) is not None]
    return statistics.fmean(vals) if vals else None
