"""How well this host repeats itself: the same `bench compare` runs measured twice, compared pair
by pair as `tutorserve sim validate` compares the simulator with a run (docs/benchmarks/planner.md).

    .venv/bin/python bench/repeat_runs.py FIRST_DIR SECOND_DIR

Matches the run JSONs of the two folders (and their subfolders) by file name and prints, for
each, goodput and p50/p90 TTFT and mean TPOT of the first run against the second, the relative
error as the simulator's is counted (first / second − 1), and how many pairs of goodput and
p50/p90 TTFT lie within 15 %: what a prediction can be held to on this host.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tutorserve.sim.setup import relative_error

METRICS = ("goodput", "p50_ttft_ms", "p90_ttft_ms", "mean_tpot_ms")
SCORED = METRICS[:3]


def _runs(folder: Path) -> dict[str, dict[str, float]]:
    """Run name → summary, for every `bench compare` result under `folder`."""
    runs = {}
    for path in sorted(folder.rglob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "summary" in data and "config" in data:
            runs[path.stem] = data["summary"]
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first", type=Path)
    ap.add_argument("second", type=Path)
    a = ap.parse_args()
    first, second = _runs(a.first), _runs(a.second)
    names = sorted(first.keys() & second.keys())
    if not names:
        raise SystemExit(f"no run of the same name in {a.first} and {a.second}")
    print("| run | " + " | ".join(f"{m} first / second (err)" for m in METRICS) + " |")
    print("|" + "---|" * (1 + len(METRICS)))
    errors = []
    for name in names:
        cells = []
        for m in METRICS:
            p, q = first[name][m], second[name][m]
            err = relative_error(p, q)
            errors += [abs(err)] if m in SCORED else []
            cells.append(f"{p:.3g} / {q:.3g} ({err:+.0%})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    within = sum(e <= 0.15 for e in errors)
    print(f"\n{within} of {len(errors)} pairs of {', '.join(SCORED)} within 15%")


if __name__ == "__main__":
    main()
