"""Decode steps of the default model on its quantized blocks, the layers in one C call
(`models/decode_step.py`) against layer by layer, on the same engine in alternating turns.

    .venv/bin/python bench/decode_step.py [--one-course] [BATCH ...]     # default 1 4

BATCH requests of the offline workload (~1,100-token prompts) are prefilled, each of a
different course (up to 8), or with `--one-course` all students of one course (up to 8),
whose decode rows then share the course prompt's blocks (cascade attention); then each turn
times 20 decode steps one way and 20 the other; 6 turns. Prints the median and the turns in
ms per step.
"""

from __future__ import annotations

import statistics
import sys
import time

from tqdm import tqdm

from tutorserve import LLM, SamplingParams
from tutorserve.bench.workloads import Request, edu_shared_prefix
from tutorserve.engine.engine import LLMEngine
from tutorserve.kernels import isa

TURNS, STEPS = 6, 20


def prefill(engine: LLMEngine) -> None:
    """Steps until every request is decoding."""
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()


def main(batches: list[int], one_course: bool) -> None:
    llm = LLM("smollm2-135m-instruct", quantization="auto")
    engine, model = llm.engine, llm.engine.model
    fused = model.fused_decode
    kernels = isa.active()
    rows = "students of one course" if one_course else "one student per course"
    print(f"kernels: {kernels.level if kernels else 'none'}; {rows}; ms per decode step")
    print("| batch | one C call | layer by layer | speed-up |\n|---|---|---|---|")
    requests = edu_shared_prefix(llm.tokenizer, seed=1)
    for batch in batches:
        if one_course:
            chosen = [r for r in requests if r.course == 0][:batch]
        else:  # one request per course: the first BATCH courses
            firsts: dict[int, Request] = {}
            for r in requests:
                firsts.setdefault(r.course, r)
            chosen = list(firsts.values())[:batch]
        if len(chosen) < batch:
            raise SystemExit(f"the workload has {len(chosen)} requests to choose; asked {batch}")
        params = SamplingParams(temperature=0, max_tokens=2 * TURNS * (STEPS + 1) + 4,
                                ignore_eos=True)  # fmt: skip
        for i, r in enumerate(chosen):
            engine.add_request(f"b{batch}-{i}", r.prompt_token_ids, params)
            if i == 0:  # students of one course then find its blocks in the prefix cache
                prefill(engine)
        prefill(engine)
        times: dict[str, list[float]] = {"fused": [], "layers": []}
        for _ in tqdm(range(TURNS), desc=f"batch {batch}", leave=False):
            for way in times:
                model.fused_decode = fused if way == "fused" else None
                engine.step()  # the first step of a way warms it
                start = time.perf_counter()
                for _ in range(STEPS):
                    engine.step()
                times[way].append((time.perf_counter() - start) / STEPS * 1e3)
        model.fused_decode = fused
        while engine.has_unfinished():
            engine.step()
        a, b = (statistics.median(times[w]) for w in ("fused", "layers"))
        print(f"| {batch} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
        for way, ts in times.items():
            print(f"  {way}: " + " ".join(f"{t:.1f}" for t in ts), file=sys.stderr)


if __name__ == "__main__":
    args = sys.argv[1:]
    one = "--one-course" in args
    main([int(a) for a in args if a != "--one-course"] or [1, 4], one)
