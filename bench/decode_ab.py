"""Paired A/B of one decode-path change, in one process: time per decode step with the change
(as in the code) and without it (the code before, patched back in), in alternating 4-step
segments on the same running batch, so the box's noise hits both sides alike.

    .venv/bin/python bench/decode_ab.py prefix-reuse --pairs 12
    .venv/bin/python bench/decode_ab.py rope-per-step --pairs 10
    .venv/bin/python bench/decode_ab.py suffix-flash --pairs 10   # a change tried and not landed
    .venv/bin/python bench/decode_ab.py in-place --pairs 10
    .venv/bin/python bench/decode_ab.py fused-norm-act --pairs 10

Workload: the offline benchmark's 64 students of 8 courses (~1,100-token prompts), run until
every request is decoding, then decode at batch 64.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import tutorserve.engine.attn_metadata as attn_metadata
import tutorserve.layers.attention as attention
import tutorserve.layers.rotary as rotary
from tutorserve import LLM, SamplingParams
from tutorserve.bench.workloads import edu_shared_prefix
from tutorserve.kernels import norm_act


def _rope_per_layer(self, positions, q, k):  # the method as it was
    cos = self.cos[positions].unsqueeze(1).to(q.dtype)
    sin = self.sin[positions].unsqueeze(1).to(q.dtype)
    return rotary._rotate(q, cos, sin), rotary._rotate(k, cos, sin)


def _suffix_flash(q, k, v, bias, scale):
    out, lse = attention._FLASH_CPU(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.0, False,
        attn_mask=None if bias is None else bias.unsqueeze(1), scale=scale,
    )  # fmt: skip
    return out.transpose(0, 1).float(), lse.transpose(0, 1).unsqueeze(-1)


def _toggles(llm: LLM) -> dict[str, tuple[str, str, Callable[[bool], None]]]:
    """change → (label with it, label without it, set(on))."""
    key, rope, attend = attn_metadata._prefix_key, rotary.RotaryEmbedding.forward, attention._attend
    supports = norm_act.supports

    def prefix(on: bool) -> None:  # a change to the gather path, which CPUs no longer take
        llm.engine.runner.in_place = False
        attn_metadata._prefix_key = key if on else (lambda *a: ())

    def rope_step(on: bool) -> None:
        rotary.RotaryEmbedding.forward = rope if on else _rope_per_layer

    def flash(on: bool) -> None:  # the gather path too
        llm.engine.runner.in_place = False
        attention._attend = _suffix_flash if on else attend

    def in_place(on: bool) -> None:
        llm.engine.runner.in_place = on

    def fused(on: bool) -> None:
        norm_act.supports = supports if on else (lambda x, width: False)

    return {
        "prefix-reuse": ("reuse", "gather every step", prefix),
        "rope-per-step": ("per step", "per layer", rope_step),
        "suffix-flash": ("flash", "unfused", flash),
        "in-place": ("kernel reads blocks in place", "gather then attend", in_place),
        "fused-norm-act": ("fused add+RMSNorm, SiLU*up", "PyTorch ops", fused),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    changes = ["fused-norm-act", "in-place", "prefix-reuse", "rope-per-step", "suffix-flash"]
    p.add_argument("change", choices=changes)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--model", default="smollm2-135m-instruct")
    a = p.parse_args()
    llm = LLM(a.model, dtype="bfloat16")
    with_it, without, switch = _toggles(llm)[a.change]
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64 + 10 * a.pairs, ignore_eos=True)
    for i, r in enumerate(edu_shared_prefix(llm.tokenizer, seed=1)):
        engine.add_request(f"p{i}", r.prompt_token_ids, params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    ms: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(a.pairs):
        for on in (True, False):
            switch(on)
            engine.step()  # the first step after a switch pays for it (e.g. a fresh gather)
            start = time.perf_counter()
            for _ in range(4):
                engine.step()
            ms[on].append((time.perf_counter() - start) / 4 * 1e3)
    switch(True)
    wins = sum(x < y for x, y in zip(ms[True], ms[False], strict=True))
    print(f"decode batch {len(sched.running)}, {a.pairs} pairs of 4 steps")
    for on, label in ((True, with_it), (False, without)):
        print(f"{label}: median {statistics.median(ms[on]):.1f} ms/step  "
              f"{[round(x) for x in ms[on]]}")  # fmt: skip
    print(f"{with_it} faster in {wins} of {a.pairs} pairs")


if __name__ == "__main__":
    main()
