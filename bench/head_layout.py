"""A decode step with the model's quantized LM head in GGUF's layout and repacked by sixteen
rows, in turns on one engine (`models/weights.py` keeps a tied head in GGUF's layout and
repacks an untied one).

    .venv/bin/python bench/head_layout.py 1 [MODEL]   # requests decoding together (≤ 64)

The default model (its Q8_0 head tied to the embedding) unless MODEL names a GGUF file (an
untied head's GGUF rows are read from it again).

Three rounds of 30 steps per layout after every request is decoding; prints ms per step and
the median of each layout.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from tutorserve import LLM
from tutorserve.bench.profile import seconds_per_step, start_decoding, stop_decoding
from tutorserve.kernels import isa, quant
from tutorserve.models.gguf_file import GGUFModel
from tutorserve.quant import QuantLinear, QuantWeight


def main(batch: int, model_name: str) -> None:
    llm = LLM(model_name, dtype="bfloat16", quantization="auto")
    model = llm.engine.model
    head = model.lm_head
    weight = QuantWeight(head.blocks[0].data, head.fmts[0], head.in_features)
    if weight.fmt in quant.REPACKED.values():  # repacked at load: GGUF's rows from the file
        tensors = GGUFModel(Path(model_name)).tensors(keep_quantized=True)
        weight = next(w for name, w in tensors if name == "lm_head.weight")
    heads = {
        "gguf": QuantLinear([weight], None, head.scratch, repack=False),
        "repacked": QuantLinear([weight], None, head.scratch),
    }
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
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "smollm2-135m-instruct")
