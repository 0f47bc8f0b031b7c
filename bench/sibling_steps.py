"""Two replicas on one host: how much longer a step runs while the other replica is stepping
(docs/benchmarks/planner.md, "Two replicas on one host slow each other down").

    .venv/bin/python bench/sibling_steps.py STEP_COST.json STEP_LOG...

Prices every logged step (step logs with start times, `serve --step-log-dir`) with a step-cost
model and prints, per kind of step (decode only, or with prefill) and by the share of the step
that another engine's steps covered (quarters), the count and the measured over predicted time:
the median per step and the ratio of the sums.
"""

from __future__ import annotations

import bisect
import statistics
import sys

from tutorserve.bench.step_cost import StepCostModel
from tutorserve.engine.step_log import LoggedStep, read_step_logs


def _overlap(step: LoggedStep, spans: dict[int, list[tuple[float, float]]]) -> float:
    """The share of `step` during which another engine was stepping."""
    t0, t1 = step.started_at, step.started_at + step.seconds
    covered = 0.0
    for engine, runs in spans.items():
        if engine == step.engine:
            continue
        i = max(bisect.bisect_right(runs, (t0, float("inf"))) - 1, 0)
        while i < len(runs) and runs[i][0] < t1:
            covered += max(0.0, min(runs[i][1], t1) - max(runs[i][0], t0))
            i += 1
    return covered / step.seconds


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    cost = StepCostModel.load(sys.argv[1])
    _, steps = read_step_logs(sys.argv[2:])
    if any(s.started_at is None for s in steps):
        raise SystemExit("these step logs have no start times (logged before 2026-12-05)")
    spans: dict[int, list[tuple[float, float]]] = {}
    for s in steps:
        spans.setdefault(s.engine, []).append((s.started_at, s.started_at + s.seconds))
    for runs in spans.values():
        runs.sort()
    buckets: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in steps:
        kind = "decode" if all(n == 1 for n, _ in s.shape.rows) else "with prefill"
        quarter = min(int(_overlap(s, spans) * 4), 3)
        buckets.setdefault((kind, quarter), []).append((s.seconds, cost.step_seconds(s.shape)))
    print("| steps | other engine stepping | count | measured / predicted: median | summed |")
    print("|---|---|---|---|---|")
    for (kind, q), pairs in sorted(buckets.items()):
        ratio = statistics.median(m / p for m, p in pairs)
        summed = sum(m for m, _ in pairs) / sum(p for _, p in pairs)
        print(f"| {kind} | {q * 25}–{q * 25 + 25} % | {len(pairs)} | {ratio:.3f} | {summed:.3f} |")


if __name__ == "__main__":
    main()
