"""How tightly a run's number of requests pins its own TTFT percentiles: a bootstrap of
`bench compare` results (docs/benchmarks/planner.md, the simulator's validation).

    .venv/bin/python bench/percentile_spread.py RUNS_DIR [--sizes 64,128,256] [--draws 2000]
    .venv/bin/python bench/percentile_spread.py --validated VALIDATE_JSON [VALIDATE_JSON ...]

For each run JSON under RUNS_DIR, draws its sessions with replacement (a session's turns stay
together: each waits for the one before) until a draw holds `size` requests, and counts how
often the p50 and p90 TTFT of a draw lie within 15 % of the run's own. A run's distribution
standing in for the truth, that is how often a prediction of the true percentile, exact but for
the run's sampling, would be within 15 % of a measured run of `size` requests: what the
simulator's "within 15 % of measured" can be held to. Requests of a run also wait on one
another, which this leaves out, so the real spread is if anything wider.

With `--validated`, each run that `tutorserve sim validate` scored is given the band its own
sampling allows (the 5th to 95th percentile of the draws, at the run's size), and each
predicted p50 and p90 TTFT is checked against the band as well as against 15 %.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tutorserve.bench.serving_metrics import RequestRecord, percentile

QUANTILES = (50, 90)
WITHIN = 0.15


def _sessions(path: Path) -> list[list[float]] | None:
    """The TTFTs (ms) of a run's completed requests, session by session; None if not a run."""
    data = json.loads(path.read_text())
    if not (isinstance(data, dict) and "records" in data and "config" in data):
        return None
    by_session: dict[int, list[float]] = {}
    for raw in data["records"]:
        r = RequestRecord(**raw)
        if r.ok:
            by_session.setdefault(r.session, []).append(1000 * r.ttft)
    return list(by_session.values())


def resampled(
    sessions: list[list[float]], size: int, draws: int, seed: int = 0
) -> dict[int, list[float]]:
    """Quantile → its value in each of `draws` resamples of `size` requests."""
    rng = random.Random(seed)
    out: dict[int, list[float]] = {q: [] for q in QUANTILES}
    for _ in range(draws):
        ttfts: list[float] = []
        while len(ttfts) < size:
            ttfts += rng.choice(sessions)
        for q in QUANTILES:
            out[q].append(percentile(ttfts, q))
    return out


def _own(sessions: list[list[float]], q: int) -> float:
    return percentile([t for s in sessions for t in s], q)


def spread_table(runs_dir: Path, sizes: list[int], draws: int) -> None:
    runs = {p.stem: s for p in sorted(runs_dir.rglob("*.json")) if (s := _sessions(p))}
    if not runs:
        raise SystemExit(f"no bench compare run under {runs_dir}")
    head = [f"p{q} TTFT at {n}" for n in sizes for q in QUANTILES]
    print("| run | requests | " + " | ".join(head) + " |")
    print("|" + "---|" * (2 + len(head)))
    total, every = dict.fromkeys(sizes, 0.0), dict.fromkeys(sizes, 1.0)
    for name, sessions in runs.items():
        cells = []
        for n in sizes:
            draws_of = resampled(sessions, n, draws)
            for q in QUANTILES:
                own = _own(sessions, q)
                share = sum(abs(v / own - 1) <= WITHIN for v in draws_of[q]) / draws
                total[n] += share
                every[n] *= share
                cells.append(f"{share:.0%}")
        print(f"| {name} | {sum(map(len, sessions))} | " + " | ".join(cells) + " |")
    pairs = len(runs) * len(QUANTILES)
    for n in sizes:
        print(
            f"\nat {n} requests: {total[n]:.1f} of {pairs} p50/p90 pairs expected within 15%;"
            f" every one of them with probability {100 * every[n]:.2g} %"
        )


def validated_table(files: list[Path], draws: int, plot_to: Path | None) -> None:
    print("| run | rate | TTFT | predicted | measured (90% band) | within 15% | in the band |")
    print("|---|---|---|---|---|---|---|")
    scored = close = inside = 0
    shown: list[tuple[str, float, float, float, float]] = []  # label, predicted, measured, band
    for f in files:
        for entry in json.loads(f.read_text()):
            sessions = _sessions(Path(entry["file"]))
            if sessions is None:
                raise SystemExit(f"{entry['file']} is not a bench compare run")
            draws_of = resampled(sessions, sum(map(len, sessions)), draws)
            for q in QUANTILES:
                predicted, measured = entry["pairs"][f"p{q}_ttft_ms"]
                lo, hi = percentile(draws_of[q], 5), percentile(draws_of[q], 95)
                near, within = abs(predicted / measured - 1) <= WITHIN, lo <= predicted <= hi
                scored, close, inside = scored + 1, close + near, inside + (near or within)
                label = f"{entry['workload']} {entry['deployment'][:2]} @{entry['rate']:g} p{q}"
                shown.append((label, predicted, measured, lo, hi))
                print(
                    f"| {entry['workload']}, {entry['deployment']} | {entry['rate']} | p{q} |"
                    f" {predicted:,.0f} | {measured:,.0f} ({lo:,.0f}–{hi:,.0f}) |"
                    f" {'yes' if near else '**no**'} | {'yes' if within else 'no'} |"
                )
    print(f"\n{close} of {scored} within 15%; {inside} of {scored} within 15% or the run's band")
    if plot_to is not None:
        _plot(shown, plot_to)


def _plot(shown: list[tuple[str, float, float, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.28 * len(shown) + 1))
    for y, (_, predicted, measured, lo, hi) in enumerate(shown):
        ax.plot([lo, hi], [y, y], color="tab:blue", lw=3, alpha=0.35)
        ax.plot([measured * (1 - WITHIN), measured * (1 + WITHIN)], [y, y], "k", lw=1)
        ax.plot(measured, y, "k|", ms=9)
        ax.plot(predicted, y, "o", color="tab:red", ms=4)
    ax.set_yticks(range(len(shown)), [s[0] for s in shown], fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel(
        "TTFT ms: measured (|) ±15 % (black), its 90 % sampling band (blue), predicted (red)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="?")
    ap.add_argument("--sizes", default="64,128,256", help="requests per resampled run")
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--validated", type=Path, nargs="+", help="validate.json files")
    ap.add_argument("--plot", type=Path, help="with --validated: a PNG of every pair")
    a = ap.parse_args()
    if (a.runs is None) == (a.validated is None):
        ap.error("give a folder of runs or --validated files, one of the two")
    if a.validated:
        validated_table(a.validated, a.draws, a.plot)
    else:
        spread_table(a.runs, [int(s) for s in a.sizes.split(",")], a.draws)


if __name__ == "__main__":
    main()
