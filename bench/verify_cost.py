"""What a decode step costs as its row carries more drafts to verify: one request of the
offline workload (~1,100 tokens of context) on the default model, each step's row given k
drafts that are all refused (the step's cost does not depend on how many are kept), with the
tied LM head in GGUF's layout and repacked by sixteen rows, in turns on one engine.

    .venv/bin/python bench/verify_cost.py [auto|none] [0,1,2,4,8]   # --quantization; drafts

Five turns of 15 steps per (head, k); prints the median ms per step and its ratio to a plain
decode step (k = 0, GGUF head).
"""

from __future__ import annotations

import statistics
import sys

from tqdm import tqdm

from tutorserve import LLM
from tutorserve.bench.profile import seconds_per_step, start_decoding
from tutorserve.kernels import isa
from tutorserve.quant import QuantLinear
from tutorserve.spec.backoff import FixedBackoff
from tutorserve.spec.proposer import Proposer

TURNS, STEPS = 5, 15


class Refused(Proposer):
    """k copies of one token: a draft the model refuses, so every step verifies k rows anew."""

    k = 0

    def propose(self, request: str, scope: bytes, tokens: list[int], k: int) -> list[int]:
        return [17] * min(self.k, k)


def main(quantization: str, drafts: list[int]) -> None:
    llm = LLM("smollm2-135m-instruct", quantization=quantization, speculative="ngram",
              num_speculative_tokens=max(drafts))  # fmt: skip
    engine, model = llm.engine, llm.engine.model
    proposer = engine.proposer = Refused()
    engine.backoff = FixedBackoff(1)
    heads = {"gguf": model.lm_head}
    if isinstance(model.lm_head, QuantLinear):
        heads["repacked"] = QuantLinear(
            [model.embed_tokens.weight()], None, model.lm_head.scratch, repack=True
        )
    start_decoding(llm, 1, 4000)
    ms: dict[tuple[str, int], list[float]] = {(h, k): [] for k in drafts for h in heads}
    for _ in tqdm(range(TURNS), desc="turns"):
        for head, k in ms:
            model.lm_head, proposer.k = heads[head], k
            engine.step()  # the first step with a new k drafts it
            ms[(head, k)].append(1000 * seconds_per_step(llm, STEPS))
    base = statistics.median(ms[("gguf", 0)])
    print(f"kernels: {isa.active().level if isa.active() else 'none'}; quantization {quantization}")
    print("| LM head | drafts | query rows | ms per step | vs a plain step |")
    print("|---|---|---|---|---|")
    for (head, k), runs in ms.items():
        m = statistics.median(runs)
        print(f"| {head} | {k} | {k + 1} | {m:.2f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "auto",
        [int(k) for k in (sys.argv[2] if len(sys.argv) > 2 else "0,1,2,4,8").split(",")],
    )
