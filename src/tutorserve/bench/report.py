"""Tables and plots for benchmark results."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


# ---- serving benchmarks --------------------------------------------------------------------------
def _label(result: dict) -> str:
    c = result["config"]
    name = c.get("system") or c["base_url"]
    killed = (c.get("fault") or {}).get("killed_at_s")  # `bench compare --kill-replica-after`
    return name if killed is None else f"{name}, a replica killed at {killed:.0f} s"


def serving_table(results: list[dict]) -> str:
    """One row per run: throughput, latency percentiles, goodput, cache hits (of all prompt
    tokens, and of what later turns carry over from their session's earlier ones)."""
    rows = [
        "| system | workload | rate req/s | done/err | req/s | out tok/s "
        "| TTFT mean / p50 / p99 ms | TPOT mean / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms "
        "| goodput req/s (SLO met) "
        "| prefix-cache hits | history cached |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c, s = r["config"], r["summary"]
        if not s.get("completed"):
            rows.append(
                f"| {_label(r)} | {c['workload']} | {c['request_rate']} | 0 | – |" + " – |" * 8
            )
            continue
        hits = s.get("server_prefix_cache_hit_rate", s.get("usage_cached_token_rate"))
        history = s.get("history_cached_token_rate")
        rows.append(
            f"| {_label(r)} | {c['workload']} | {c['request_rate']} "
            f"| {s['completed']:.0f}/{s['errors']:.0f} | {s['request_throughput']:.2f} "
            f"| {s['output_throughput']:.1f} "
            f"| {s['mean_ttft_ms']:.0f} / {s['p50_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} "
            f"| {s['mean_tpot_ms']:.0f} / {s['p99_tpot_ms']:.0f} "
            f"| {s['p50_itl_ms']:.0f} / {s['p99_itl_ms']:.0f} "
            f"| {s['p50_e2e_ms']:.0f} / {s['p99_e2e_ms']:.0f} "
            f"| {s['goodput']:.2f} ({100 * s['slo_attainment']:.0f}%) "
            f"| {'–' if hits is None else f'{100 * hits:.0f}%'} "
            f"| {'–' if history is None else f'{100 * history:.0f}%'} |"
        )
    return "\n".join(rows)


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(values)
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def serving_plots(results: list[dict], out: Path, title: str) -> None:
    """TTFT and end-to-end latency CDFs per system at the highest rate, and goodput by rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    by_system: dict[str, list[dict]] = {}
    for r in results:
        by_system.setdefault(_label(r), []).append(r)
    for name, runs in by_system.items():
        runs.sort(key=lambda r: float(r["config"]["request_rate"]))
        top = [x for x in runs[-1]["records"] if x["error"] is None and x["chunk_times"]]
        if top:
            _cdf(ax1, [x["chunk_times"][0] - x["start"] for x in top], name)
            _cdf(ax2, [x["end"] - x["start"] for x in top], name)
        rates = [float(r["config"]["request_rate"]) for r in runs]
        ax3.plot(rates, [r["summary"].get("goodput", 0.0) for r in runs], "o-", label=name)
    top_rate = max((float(r["config"]["request_rate"]) for r in results), default=0)
    ax1.set_xlabel(f"TTFT (s) at {top_rate:g} req/s")
    ax2.set_xlabel(f"end-to-end latency (s) at {top_rate:g} req/s")
    for ax in (ax1, ax2):
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
    ax3.set_xlabel("request rate (req/s)")
    ax3.set_ylabel("goodput (req/s meeting every SLO)")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def goodput_ratios(results: list[dict], ours: str = "tutorserve") -> list[str]:
    """Our goodput over each peer's, rate by rate."""
    table: dict[tuple[str, str], float] = {
        (_label(r), str(r["config"]["request_rate"])): r["summary"].get("goodput", 0.0)
        for r in results
    }
    lines = []
    for (name, rate), good in sorted(table.items()):
        mine = table.get((ours, rate))
        if name == ours or mine is None:
            continue
        verdict = f"{mine / good:.2f}×" if good else ("∞ (peer met no SLO)" if mine else "both 0")
        lines.append(
            f"- at {rate} req/s: {ours} goodput {mine:.3f} vs {name} {good:.3f} → {verdict}"
        )
    return lines


def speculation_lines(results: list[dict]) -> list[str]:
    """Drafted and accepted tokens of each run whose server speculated (its /metrics)."""
    return [
        f"- {_label(r)} at {r['config']['request_rate']} req/s: "
        f"{s['spec_accepted_tokens']:,.0f} of {s['spec_draft_tokens']:,.0f} drafted tokens "
        f"accepted ({s['spec_acceptance_rate']:.0%})"
        for r in results
        if "spec_draft_tokens" in (s := r["summary"])
    ]


def roofline_lines(results: list[dict], bound: Callable[[float, int], float]) -> list[str]:
    """Each run's output rate as a share of the decode bound at its mean concurrency (Little's
    law: the sum of request latencies over the run's duration) and mean context."""
    lines = []
    for r in results:
        s, done = r["summary"], [x for x in r["records"] if x["end"] is not None]
        if not s.get("completed") or not done:
            continue
        concurrency = sum(x["end"] - x["start"] for x in done) / s["duration_s"]
        context = round(sum(x["prompt_tokens"] + x["output_tokens"] / 2 for x in done) / len(done))
        limit, got = bound(concurrency, context), s["output_throughput"]
        lines.append(
            f"- {_label(r)} at {r['config']['request_rate']} req/s: "
            f"{got:.1f} output tok/s = {100 * got / limit:.0f}% "
            f"of the decode bound at its mean concurrency {concurrency:.1f} ({limit:.0f} tok/s)"
        )
    return lines
