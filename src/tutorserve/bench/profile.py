"""`tutorserve bench profile-decode`: where a decode step's time goes.

Loads the offline workload (64 students of 8 courses, ~1,100-token prompts; `batch` of them),
runs until every request is decoding, then profiles a few decode steps with `torch.profiler`.
`bench roofline --measure` times decode steps the same way.
"""

from __future__ import annotations

import time

from torch.profiler import ProfilerActivity, profile

from tutorserve import LLM, SamplingParams
from tutorserve.bench.workloads import edu_shared_prefix


def start_decoding(llm: LLM, batch: int, max_tokens: int) -> tuple[int, int]:
    """Add `batch` requests of the workload and step until every one is decoding, then two
    steps more (the decode-shaped workspace warms up); returns how many are running and their
    mean context in tokens."""
    engine, sched = llm.engine, llm.engine.scheduler
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, r in enumerate(edu_shared_prefix(llm.tokenizer, seed=1)[:batch]):
        engine.add_request(f"p{i}", r.prompt_token_ids, params)
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(2):
        engine.step()
    running = sched.running
    return len(running), round(sum(len(s.token_ids) for s in running) / len(running))


def stop_decoding(llm: LLM) -> None:
    """Abort every running request (the next batch starts on an empty schedule)."""
    for s in list(llm.engine.scheduler.running):
        llm.engine.abort_request(s.request_id)


def seconds_per_step(llm: LLM, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    return (time.perf_counter() - start) / steps


def profile_decode(
    model: str, dtype: str, steps: int, rows: int, batch: int, quantization: str
) -> str:
    llm = LLM(model, dtype=dtype, quantization=quantization)
    batch, _ = start_decoding(llm, batch, 2 * steps + 8)
    per_step = seconds_per_step(llm, steps)  # without the profiler, whose overhead is large here
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return (
        f"decode batch {batch}: {1000 * per_step:.1f} ms per step unprofiled; "
        f"the table sums {steps} profiled steps\n{table}"
    )
