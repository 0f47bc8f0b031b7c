"""A decode step with the bf16 KV cache as rows and paired (`kernels/kv_format.h`), in turns in
one process: one engine per layout, the same requests decoding on each, so that the machine's
moods hit both alike.

    .venv/bin/python bench/paired_kv.py 1 [--advance N] [--model M]   # requests decoding (≤ 64)

The default model unless `--model` names another (a registered name or a GGUF). Every request
of the offline workload (~1,100-token prompts) decodes, `--advance` steps lengthen the context,
then fifteen rounds of 40 steps per engine (600 tokens more, alike on both); prints the context
and each layout's ms per step, and their medians.
"""

from __future__ import annotations

import argparse
import statistics
from unittest import mock

from tutorserve import LLM
from tutorserve.bench.profile import seconds_per_step, start_decoding
from tutorserve.kernels import isa
from tutorserve.kernels import paged_attention as kernel

ROUNDS, STEPS = 15, 40


def engine(model: str, paired: bool) -> LLM:
    """`model` in bf16 with its KV cache laid out as asked (the backend asks `pairs_kv` once,
    when the engine starts)."""
    with mock.patch.object(kernel, "pairs_kv", lambda *_: paired):
        llm = LLM(model, dtype="bfloat16")
    assert llm.engine.runner.backend.paired_kv is paired
    return llm


def main(batch: int, advance: int, model: str) -> None:
    llms = {"rows": engine(model, False), "paired": engine(model, True)}
    for llm in llms.values():
        _, context = start_decoding(llm, batch, advance + ROUNDS * STEPS + 100)
        for _ in range(advance):
            llm.engine.step()
    ms: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(ROUNDS):
        for name, llm in llms.items():
            ms[name].append(1000 * seconds_per_step(llm, STEPS))
    start = context + advance
    print(f"{model}, kernels {isa.active().level}; {batch} rows, context {start} → "
          f"{start + ROUNDS * STEPS} tokens; ms per step")  # fmt: skip
    for name, runs in ms.items():
        print(f"KV as {name}: {[round(t, 2) for t in runs]}, median "
              f"{statistics.median(runs):.2f}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batch", type=int)
    parser.add_argument("--advance", type=int, default=0)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    main(args.batch, args.advance, args.model)
