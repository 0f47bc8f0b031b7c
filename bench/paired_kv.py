"""SmolLM2's decode step with its bf16 KV cache as rows and paired (`kernels/kv_format.h`), in
turns in one process: one engine per layout, the same requests
decoding on each, so that the machine's moods hit both alike.

    .venv/bin/python bench/paired_kv.py 1 [ADVANCE]   # requests decoding together (≤ 64)

Every request of the offline workload (~1,100-token prompts) decodes, `ADVANCE` steps (default
0) lengthen the context, then fifteen rounds of 40 steps per engine (600 tokens more, alike on
both); prints the context and each layout's ms per step, and their medians.
"""

from __future__ import annotations

import statistics
import sys
from unittest import mock

from tutorserve import LLM
from tutorserve.bench.profile import seconds_per_step, start_decoding
from tutorserve.kernels import isa
from tutorserve.kernels import paged_attention as kernel

ROUNDS, STEPS = 15, 40


def engine(paired: bool) -> LLM:
    """The default model in bf16 with its KV cache laid out as asked (the backend asks
    `pairs_kv` once, when the engine starts)."""
    with mock.patch.object(kernel, "pairs_kv", lambda *_: paired):
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16")
    assert llm.engine.runner.backend.paired_kv is paired
    return llm


def main(batch: int, advance: int) -> None:
    llms = {"rows": engine(False), "paired": engine(True)}
    for llm in llms.values():
        _, context = start_decoding(llm, batch, advance + ROUNDS * STEPS + 100)
        for _ in range(advance):
            llm.engine.step()
    ms: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(ROUNDS):
        for name, llm in llms.items():
            ms[name].append(1000 * seconds_per_step(llm, STEPS))
    start = context + advance
    print(f"kernels {isa.active().level}; {batch} rows, context {start} → "
          f"{start + ROUNDS * STEPS} tokens; ms per step")  # fmt: skip
    for name, runs in ms.items():
        print(f"KV as {name}: {[round(t, 2) for t in runs]}, median "
              f"{statistics.median(runs):.2f}")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
