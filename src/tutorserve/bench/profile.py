"""`tutorserve bench profile-decode`: where a decode step's time goes.

Loads the offline workload (64 students of 8 courses, ~1,100-token prompts; `batch` of them),
runs until every request is decoding, then profiles a few decode steps with `torch.profiler`.
"""

from __future__ import annotations

import time

from torch.profiler import ProfilerActivity, profile

from tutorserve import LLM, SamplingParams
from tutorserve.bench.workloads import edu_shared_prefix


def profile_decode(
    model: str, dtype: str, steps: int, rows: int, batch: int, quantization: str
) -> str:
    llm = LLM(model, dtype=dtype, quantization=quantization)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    for i, r in enumerate(edu_shared_prefix(llm.tokenizer, seed=1)[:batch]):
        engine.add_request(f"p{i}", r.prompt_token_ids, params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(2):  # warm up the decode-shaped workspace
        engine.step()
    batch = len(sched.running)
    start = time.perf_counter()  # timed without the profiler, whose overhead is large here
    for _ in range(steps):
        engine.step()
    per_step = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return (
        f"decode batch {batch}: {1000 * per_step:.1f} ms per step unprofiled; "
        f"the table sums {steps} profiled steps\n{table}"
    )
