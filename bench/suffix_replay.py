"""The suffix proposer replayed on a class's greedy tutor replies, without timing: greedy
speculation keeps exactly the tokens plain decoding gives, so one plain run's replies say which
drafts a proposer's would have kept, at one request in flight, free of the box's run-to-run
noise. The prompts are `bench spec`'s (students each send one of a problem's known wrong
answers); the replies are decoded batch-invariant, so they are those of any concurrency.

    .venv/bin/python bench/suffix_replay.py [--students 6] [--num-prompts 64] [--max-tokens 96]
        [--draft-cost 0.26]

Prints the drafts by where they came from (another request's text, by how many tokens back the
request agreed with it; or its own text), the share of their tokens kept, and the run's decode
steps and drafted tokens; `--draft-cost` (a drafted token's cost in plain steps, as
`bench/verify_cost.py` measures it) turns those into a modelled speed-up.
"""

from __future__ import annotations

import argparse
from collections import Counter

from tutorserve import LLM, SamplingParams
from tutorserve.bench.speculative import tutor_prompts
from tutorserve.spec import SuffixProposer, scope_key
from tutorserve.spec import suffix as suffix_module

BUCKETS = (0, 8, 16, 32, 64)  # agreement bucket: the largest bound at or below it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--students", type=int, default=6)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft-cost", type=float, default=0.26)
    args = ap.parse_args()

    llm = LLM("smollm2-135m-instruct", batch_invariant=True)
    prompts = [llm.engine.tokenizer.encode_chat(m) for m in tutor_prompts(args.students)]
    prompts = prompts[: args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    replies = [o.token_ids for o in llm.generate(prompts, params)]

    agreed: list[int | None] = [None]  # the agreement of the last scope draft
    measure = suffix_module._agreement

    def spy(tokens: list[int], other: list[int], end: int) -> int:
        agreed[0] = measure(tokens, other, end)
        return agreed[0]

    suffix_module._agreement = spy
    proposer, k = SuffixProposer(), SuffixProposer.max_drafts
    drafts, drafted, kept = Counter(), Counter(), Counter()
    steps = plain = 0
    for i, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        name, scope = f"r{i}", scope_key(prompt, None)
        tokens = [*prompt, reply[0]]
        proposer.observe(name, scope, tokens, len(prompt))
        plain += len(reply) - 1
        at = 1
        while at < len(reply):
            agreed[0] = None
            draft = proposer.propose(name, scope, tokens, min(k, args.max_tokens - at - 1))
            n = 0
            while n < len(draft) and at + n < len(reply) and draft[n] == reply[at + n]:
                n += 1
            if draft:
                where = (
                    "own text" if agreed[0] is None else max(b for b in BUCKETS if b <= agreed[0])
                )
                drafts[where] += 1
                drafted[where] += len(draft)
                kept[where] += n
            tokens += reply[at : at + n + 1]
            at += n + 1
            steps += 1
            proposer.observe(name, scope, tokens, len(prompt))

    print("| drafted from | drafts | drafted tokens | kept |")
    print("|---|---|---|---|")
    for where in [*BUCKETS, "own text"]:
        if drafts[where]:
            label = where if isinstance(where, str) else f"another request, agreeing over {where}+"
            share = kept[where] / drafted[where]
            print(f"| {label} | {drafts[where]} | {drafted[where]} | {share:.0%} |")
    total = sum(drafted.values())
    cost = steps + args.draft_cost * total
    print(f"decode steps {steps} (plain decoding: {plain}), drafted {total}, kept "
          f"{sum(kept.values())}; at {args.draft_cost} of a step a drafted token, "
          f"{plain / cost:.2f}x fewer step-equivalents")  # fmt: skip


if __name__ == "__main__":
    main()
