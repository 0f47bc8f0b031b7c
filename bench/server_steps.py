"""The engine's steps inside the server, each set beside what a step-cost model predicts for its
shape: where the simulator's steps and the server's part (docs/benchmarks/planner.md).

    .venv/bin/python bench/server_steps.py --step-cost CAL/step-cost.json --num-threads 1 --out DIR

Starts `tutorserve serve` as `bench compare` starts `tutorserve-notiers` (KV pool 0.2 GB), with
its step log on (`--step-log-dir DIR/steps`); drives it with `bench serve`'s edu-shared-prefix
run (64 requests, seed 1); stops it. Writes DIR/run.json (the `bench serve` result, with the
server's argv so that `tutorserve sim validate` replays it) and DIR/compare.json, and prints per
kind of step (decode only, decode with a prefill chunk, prefill only; those of more tokens than
the quantized weights multiply on their blocks apart) the steps' count, measured and predicted
sums, and the median error per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from tutorserve.bench.client import ClientConfig
from tutorserve.bench.serving import run_benchmark
from tutorserve.bench.serving_metrics import SLO
from tutorserve.bench.step_cost import StepCostModel
from tutorserve.bench.systems import ModelFiles, RunningServer, ServeSpec, tutorserve_server
from tutorserve.engine.scheduler import StepShape
from tutorserve.engine.step_log import LoggedStep, read_step_logs
from tutorserve.models.loader import load_tokenizer
from tutorserve.models.registry import resolve

MODEL, PORT = "smollm2-135m-instruct", 8124


def _kind(shape: StepShape, dequant_rows: int | None) -> str:
    decode = sum(n == 1 for n, _ in shape.rows)
    kind = "decode" if decode == len(shape.rows) else "mixed" if decode else "prefill"
    if dequant_rows is not None and sum(n for n, _ in shape.rows) > dequant_rows:
        kind += f", > {dequant_rows} tokens"
    return kind


def compare(
    steps: list[LoggedStep],
    cost: StepCostModel,
    dequant_rows: int | None,
) -> dict[str, dict[str, float]]:
    """Per kind of step (dequantizing ones apart when `dequant_rows` is given): the count, the
    measured and predicted sums, the median error per step."""
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for step in steps:
        pair = (cost.step_seconds(step.shape), step.seconds)
        by_kind.setdefault(_kind(step.shape, dequant_rows), []).append(pair)
    by_kind["all"] = [p for pairs in list(by_kind.values()) for p in pairs]
    return {
        kind: {
            "steps": len(pairs),
            "measured_s": sum(m for _, m in pairs),
            "predicted_s": sum(p for p, _ in pairs),
            "median_error": statistics.median((p - m) / m for p, m in pairs),
        }
        for kind, pairs in sorted(by_kind.items())
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-cost", required=True, help="a `bench calibrate` step-cost.json")
    ap.add_argument("--num-threads", type=int, help="the server engine's threads")
    ap.add_argument("--request-rate", type=float, default=0.9)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    cost = StepCostModel.load(a.step_cost)
    a.out.mkdir(parents=True, exist_ok=True)
    files = ModelFiles(MODEL, str(resolve(MODEL)), hf_dir="")
    system = tutorserve_server("tutorserve-notiers", ServeSpec(files, PORT, 32, 0.2), tiers=False)
    if a.num_threads is not None:
        system.argv += ["--num-threads", str(a.num_threads)]
    system.argv += ["--step-log-dir", str(a.out / "steps")]
    log = Path(tempfile.mkdtemp(prefix="server-steps-")) / "server.log"
    with RunningServer(system, PORT, log):
        run = run_benchmark(ClientConfig(f"http://127.0.0.1:{PORT}", MODEL, None, None),
                            load_tokenizer(MODEL), workload="edu-shared-prefix", num_requests=64,
                            request_rate=a.request_rate, slo=SLO(3000, 250), seed=1)  # fmt: skip
    run["config"].update(system="tutorserve-notiers", argv=system.argv, command=" ".join(sys.argv))
    (a.out / "run.json").write_text(json.dumps(run, indent=1))
    result = compare(read_step_logs([a.out / "steps"])[1], cost, cost.dequant_rows)
    (a.out / "compare.json").write_text(json.dumps({"step_cost": a.step_cost, **result}, indent=1))
    print(table(result))


def table(result: dict[str, dict[str, float]]) -> str:
    lines = ["| steps | count | measured s | predicted s | summed error | median error per step |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for kind, r in result.items():
        summed = r["predicted_s"] / r["measured_s"] - 1
        lines.append(f"| {kind} | {r['steps']} | {r['measured_s']:.2f} | {r['predicted_s']:.2f} | "
                     f"{summed:+.1%} | {r['median_error']:+.1%} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
