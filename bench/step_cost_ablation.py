"""The step-cost model with and without its dequantizing feature (`dequant_steps`), on the same
measured steps (docs/benchmarks/planner.md).

    .venv/bin/python bench/step_cost_ablation.py CAL_DIR [--server-steps DIR/steps]

Refits a `bench calibrate` run's saved samples (CAL_DIR/calibrate-samples.json) both ways, prints
each model's error on the held-out steps and, given the steps `bench/server_steps.py` recorded in
the server, each model's prediction of them per kind of step (those of more tokens than the
quantized weights multiply on their blocks apart for both).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from server_steps import compare, table

from tutorserve.bench.step_cost import StepCostModel
from tutorserve.engine.scheduler import StepShape
from tutorserve.engine.step_log import read_step_logs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calibration", type=Path, help="a `bench calibrate --out` folder")
    ap.add_argument(
        "--server-steps",
        nargs="+",
        help="step logs (files or folders, e.g. a bench/server_steps.py DIR/steps)",
    )
    a = ap.parse_args()
    rows = StepCostModel.load(a.calibration / "step-cost.json").dequant_rows
    samples = json.loads((a.calibration / "calibrate-samples.json").read_text())
    shapes = [StepShape(tuple(map(tuple, s["rows"]))) for s in samples]
    fit = [i for i, s in enumerate(samples) if not s["held_out"]]
    test = [i for i, s in enumerate(samples) if s["held_out"]]
    for name, dequant_rows in (("without dequant_steps", None), ("with dequant_steps", rows)):
        model = StepCostModel.fit([shapes[i] for i in fit], [samples[i]["seconds"] for i in fit],
                                  dequant_rows, source=name)  # fmt: skip
        held_out = [samples[i]["seconds"] for i in test]
        error = model.held_out_error([shapes[i] for i in test], held_out)
        coef = ", ".join(f"{c:.3g}" for c in model.coef)
        print(f"\n{name}: coefficients {coef}; held-out steps {error['steps']}: median error "
              f"{error['median_rel_error']:.1%}, mean {error['mean_rel_error']:.1%}, p90 "
              f"{error['p90_rel_error']:.1%}, summed {error['total_time_error']:+.1%}")  # fmt: skip
        if a.server_steps:
            print(table(compare(read_step_logs(a.server_steps)[1], model, rows)))


if __name__ == "__main__":
    main()
