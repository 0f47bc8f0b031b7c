"""The default model's decode step with its tied Q8_0 LM head in GGUF's layout and repacked by
sixteen rows (`models/weights.py` keeps GGUF's), in turns on one engine.

    .venv/bin/python bench/head_layout.py 1   # requests decoding together (≤ 64)

Three rounds of 30 steps per layout after every request is decoding; prints ms per step and
the median of each layout.
"""

from __future__ import annotations

import statistics
import sys

from tutorserve import LLM
from tutorserve.bench.profile import seconds_per_step, start_decoding, stop_decoding
from tutorserve.kernels import isa
from tutorserve.quant import QuantLinear


def main(batch: int) -> None:
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", quantization="auto")
    model = llm.engine.model
    heads = {"gguf": model.lm_head}
    heads["repacked"] = QuantLinear(
        [model.embed_tokens.weight()], None, model.lm_head.scratch, repack=True
    )
    print(f"kernels: {isa.active().level}; heads: {[h.fmts for h in heads.values()]}")
    ms: dict[str, list[float]] = {name: [] for name in heads}
    for _ in range(3):
        for name, head in heads.items():
            model.lm_head = head
            start_decoding(llm, batch, 200)
            ms[name].append(1000 * seconds_per_step(llm, 30))
            stop_decoding(llm)
    for name, runs in ms.items():
        print(f"batch {batch}, head {name}: {[round(t, 2) for t in runs]} ms, median "
              f"{statistics.median(runs):.2f}")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]))
