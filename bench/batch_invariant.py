"""`--batch-invariant` on the default model (bf16, its blocks): what it keeps and what it costs.

    .venv/bin/python bench/batch_invariant.py same   # greedy replies alone vs 16 in flight
    .venv/bin/python bench/batch_invariant.py cost   # prefill tok/s, decode ms/step at 1, 8, 64

`same`: 16 students of two courses (`edu-shared-prefix`, ~1,100-token prompts), 32 greedy
tokens each, one request at a time and all 16 in flight, with and without the option: how many
replies are the same both ways. `cost`: 16 prompts of distinct courses prefilled (one output
token each, no prefix caching), then decode steps of `bench.profile` at batch 1, 8 and 64;
each mode in a fresh engine, the two modes in turns, twice.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from tutorserve import LLM, SamplingParams
from tutorserve.bench.profile import seconds_per_step, start_decoding, stop_decoding
from tutorserve.bench.workloads import edu_shared_prefix
from tutorserve.kernels import isa

MODEL, BATCHES = "smollm2-135m-instruct", (1, 8, 64)


def replies(invariant: bool, in_flight: int) -> list[list[int]]:
    llm = LLM(MODEL, dtype="bfloat16", batch_invariant=invariant, max_num_seqs=in_flight)
    requests = [r for r in edu_shared_prefix(llm.tokenizer, seed=1) if r.course in (0, 1)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([r.prompt_token_ids for r in requests[:16]], params)
    llm.engine.close()
    return [o.token_ids for o in outs]


def same() -> None:
    for invariant in (True, False):
        alone, together = replies(invariant, 1), replies(invariant, 16)
        equal = sum(a == b for a, b in zip(alone, together, strict=True))
        print(f"batch_invariant={invariant}: {equal}/{len(alone)} replies the same alone and "
              f"16 in flight")  # fmt: skip


def cost_row(invariant: bool) -> str:
    llm = LLM(MODEL, dtype="bfloat16", batch_invariant=invariant, enable_prefix_caching=False)
    prompts = [r.prompt_token_ids for r in edu_shared_prefix(llm.tokenizer, seed=3)[:16]]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts[:2], one)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, one)
    cells = [f"{sum(map(len, prompts)) / (time.perf_counter() - start):.0f}"]
    for batch in BATCHES:
        start_decoding(llm, batch, 40)
        cells.append(f"{1000 * seconds_per_step(llm, 40 if batch <= 8 else 20):.1f}")
        stop_decoding(llm)
    llm.engine.close()
    return f"| {'on' if invariant else 'off'} | " + " | ".join(cells) + " |"


def cost() -> None:
    rows = [cost_row(inv) for _ in range(2) for inv in tqdm((True, False), desc="engines")]
    print(f"kernels {isa.active().level}\n| batch_invariant | prefill tok/s | "
          + " | ".join(f"batch {b} ms/step" for b in BATCHES)
          + " |\n|---|---|" + "---|" * len(BATCHES))  # fmt: skip
    print("\n".join(rows))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("same", "cost"):
        sys.exit(__doc__)
    same() if sys.argv[1] == "same" else cost()
