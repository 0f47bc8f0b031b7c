"""What the proposers' bookkeeping costs a batch-64 step when speculation is paused (above
`--speculative-disable-by-batch-size`): the engine still shows each proposer every appended
token. 64 requests of 4 courses (~600-token prompts) decode 400 steps of tokens drawn from
2,000 ids, so n-grams repeat as tutoring replies do. Prints the mean and the worst step, and the
garbage collector's pauses (the server process runs the same collector).

    .venv/bin/python bench/suffix_observe.py
"""

from __future__ import annotations

import gc
import random
import time

from tutorserve.spec import NgramProposer, SuffixProposer

ROWS, STEPS, PROMPT = 64, 400, 600


def main() -> None:
    pauses: list[float] = []
    started = [0.0]

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    gc.callbacks.append(timer)
    for name, make in (("suffix", SuffixProposer), ("ngram", NgramProposer)):
        gc.collect()
        pauses.clear()
        rng, proposer = random.Random(0), make()
        rows = [(f"r{i}", bytes([i % 4]), [rng.randrange(49152) for _ in range(PROMPT)])
                for i in range(ROWS)]  # fmt: skip
        steps = []
        for _ in range(STEPS):
            t = time.perf_counter()
            for request, scope, tokens in rows:
                tokens.append(rng.randrange(2000))
                proposer.observe(request, scope, tokens, PROMPT)
            steps.append(time.perf_counter() - t)
        print(
            f"{name}: {sum(steps) / STEPS * 1e3:.2f} ms a step, worst {max(steps) * 1e3:.1f} ms; "
            f"{len(pauses)} collections, longest {max(pauses, default=0) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
