"""The engine's steps inside the server, each set beside what a step-cost model predicts for its
shape: where the simulator's steps and the server's part (docs/benchmarks/planner.md).

    .venv/bin/python bench/server_steps.py --step-cost CAL/step-cost.json --num-threads 1 --out DIR

Starts `tutorserve serve` as `bench compare` starts `tutorserve-notiers` (KV pool 0.2 GB), with
every engine step's shape and wall time recorded; drives it with `bench serve`'s edu-shared-prefix
run (64 requests, seed 1); stops it. Writes DIR/run.json (the `bench serve` result, with the
server's argv so that `tutorserve sim validate` replays it), DIR/steps.json (each step: its shape,
seconds) and DIR/compare.json, and prints per kind of step (decode only, decode with a prefill
chunk, prefill only; those of more tokens than the quantized weights multiply on their blocks
apart) the steps' count, measured and predicted sums, and the median error per step.
"""

from __future__ import annotations

import argparse
import atexit
import json
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from tutorserve.bench.client import ClientConfig
from tutorserve.bench.serving import run_benchmark
from tutorserve.bench.serving_metrics import SLO
from tutorserve.bench.step_cost import StepCostModel
from tutorserve.bench.systems import ModelFiles, RunningServer, ServeSpec, tutorserve_server
from tutorserve.engine.scheduler import StepShape
from tutorserve.models.loader import load_tokenizer
from tutorserve.models.registry import resolve

MODEL, PORT = "smollm2-135m-instruct", 8124


def _serve_recording(steps_path: str, serve_argv: list[str]) -> int:
    """The server's process: `tutorserve serve` whose engine keeps a step log, written at exit
    (the harness stops the server with SIGINT, after which uvicorn returns)."""
    from tutorserve.cli import main
    from tutorserve.engine.engine import LLMEngine

    engines: list[LLMEngine] = []
    init = LLMEngine.__init__

    def recording_init(self: LLMEngine, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        self.step_log = []
        engines.append(self)

    def dump() -> None:
        steps = [{"shape": asdict(r.shape), "seconds": r.step_s}
                 for e in engines for r in e.step_log or []]  # fmt: skip
        Path(steps_path).write_text(json.dumps(steps))

    LLMEngine.__init__ = recording_init
    atexit.register(dump)
    return main(serve_argv)


def _kind(shape: StepShape, dequant_rows: int | None) -> str:
    decode = sum(n == 1 for n, _ in shape.rows)
    kind = "decode" if decode == len(shape.rows) else "mixed" if decode else "prefill"
    if dequant_rows is not None and sum(n for n, _ in shape.rows) > dequant_rows:
        kind += f", > {dequant_rows} tokens"
    return kind


def compare(
    steps: list[dict], cost: StepCostModel, dequant_rows: int | None
) -> dict[str, dict[str, float]]:
    """Per kind of step (dequantizing ones apart when `dequant_rows` is given): the count, the
    measured and predicted sums, the median error per step."""
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for step in steps:
        shape = StepShape(**{**step["shape"], "rows": tuple(map(tuple, step["shape"]["rows"]))})
        pair = (cost.step_seconds(shape), step["seconds"])
        by_kind.setdefault(_kind(shape, dequant_rows), []).append(pair)
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
    if sys.argv[1:2] == ["_record"]:
        sys.exit(_serve_recording(sys.argv[2], sys.argv[3:]))
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
    steps_path = a.out / "steps.json"
    serve_argv = system.argv[system.argv.index("serve") :]
    system.argv = [sys.executable, __file__, "_record", str(steps_path), *serve_argv]
    log = Path(tempfile.mkdtemp(prefix="server-steps-")) / "server.log"
    with RunningServer(system, PORT, log):
        run = run_benchmark(ClientConfig(f"http://127.0.0.1:{PORT}", MODEL, None, None),
                            load_tokenizer(MODEL), workload="edu-shared-prefix", num_requests=64,
                            request_rate=a.request_rate, slo=SLO(3000, 250), seed=1)  # fmt: skip
    run["config"].update(system="tutorserve-notiers", argv=[sys.executable, "-m", "tutorserve.cli",
                         *serve_argv], command=" ".join(sys.argv))  # fmt: skip
    (a.out / "run.json").write_text(json.dumps(run, indent=1))
    result = compare(json.loads(steps_path.read_text()), cost, cost.dequant_rows)
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
