"""One prefill chunk after a cached prompt, timed at sizes around the rows that quantized weights
multiply on their blocks: the step that crosses them pays for dequantizing the weights
(docs/benchmarks/planner.md, the step-cost model's `dequant_steps`).

    .venv/bin/python bench/dequant_step.py [--num-threads T] [--gemv-rows N]

The default model (SmolLM2-135M, Q4_1 blocks); a random 1,024-token prompt is computed first,
then 5 requests that add N tokens of their own to it; the median time of their one step.
`--gemv-rows` moves the repacked formats' limit (`quant.layers.GEMV_ROWS`) for this run, to
find where multiplying on the blocks stops paying in a whole step.
"""

from __future__ import annotations

import argparse
import random
import statistics

from tutorserve import LLM, SamplingParams
from tutorserve.quant import layers
from tutorserve.quant.layers import dequantizing_rows

SIZES = (16, 32, 48, 64, 65, 80, 96, 128, 192, 256, 384, 512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-threads", type=int)
    ap.add_argument("--gemv-rows", type=int)
    a = ap.parse_args()
    if a.gemv_rows is not None:
        layers.GEMV_ROWS = dict.fromkeys(layers.GEMV_ROWS, a.gemv_rows)
    llm = LLM("smollm2-135m-instruct", num_threads=a.num_threads)
    engine, rng = llm.engine, random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, engine.model.config.vocab_size - 100) for _ in range(n)]

    rows = dequantizing_rows(engine.model, engine.dtype)
    print(f"weights dequantized above {rows} tokens per step")
    print("| tokens computed (after 1,024 cached) | step ms (median of 5) |\n|---|---|")
    for n in SIZES:
        cached = tokens(1024)
        llm.generate([cached], params)
        times = []
        for _ in range(5):
            engine.step_log = []
            llm.generate([cached + tokens(n)], params)
            times.append(engine.step_log[0].step_s)
        engine.step_log = None
        print(f"| {n} | {1000 * statistics.median(times):.1f} |")


if __name__ == "__main__":
    main()
