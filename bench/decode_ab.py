"""Paired A/B of one decode-path change, in one process: time per decode step with the change
(as in the code) and without it (the code before, patched back in), in alternating 4-step
segments on the same running batch, so the box's noise hits both sides alike.

    .venv/bin/python bench/decode_ab.py prefix-reuse --pairs 12
    .venv/bin/python bench/decode_ab.py rope-per-step --pairs 10
    .venv/bin/python bench/decode_ab.py suffix-flash --pairs 10   # a change tried and not landed
    .venv/bin/python bench/decode_ab.py in-place --pairs 10
    .venv/bin/python bench/decode_ab.py fused-norm-act --pairs 10
    .venv/bin/python bench/decode_ab.py rope-kv-kernels --batch 1 --quantization auto
    .venv/bin/python bench/decode_ab.py repack16 --batch 1 --quantization auto   # two engines
    .venv/bin/python bench/decode_ab.py kv-bf16 --dtype float32   # two engines, same requests
    .venv/bin/python bench/decode_ab.py bf16-gemm --batch 64 --quantization auto --model M
    TUTORSERVE_CPU_ISA=avx2 .venv/bin/python bench/decode_ab.py in-place --batch 16 \
        --dtype float32 --kv-cache-dtype bfloat16   # one ISA level of the kernels, forced

Workload: the offline benchmark's 64 students of 8 courses (~1,100-token prompts; `--batch N`
takes the first N, students dealt round the courses), run until every request is
decoding, then decode at batch N. `TUTORSERVE_CPU_ISA` picks the kernels' level.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import tutorserve.layers.attention.gather as gather
import tutorserve.layers.attention.metadata as metadata
import tutorserve.layers.rotary as rotary
from tutorserve import LLM, SamplingParams
from tutorserve.bench.workloads import edu_shared_prefix
from tutorserve.kernels import isa, norm_act
from tutorserve.kernels import paged_attention as attention_kernels
from tutorserve.kernels import rotary as rotary_kernel
from tutorserve.layers.attention.gather import GatherBackend
from tutorserve.quant import QuantLinear, QuantWeight


def _rope_per_layer(self, positions, q, k):  # the method as it was
    cos = self.cos[positions].unsqueeze(1).to(q.dtype)
    sin = self.sin[positions].unsqueeze(1).to(q.dtype)
    return rotary._rotate(q, cos, sin), rotary._rotate(k, cos, sin)


def _suffix_flash(q, k, v, bias, scale):
    out, lse = gather._FLASH_CPU(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.0, False,
        attn_mask=None if bias is None else bias.unsqueeze(1), scale=scale,
    )  # fmt: skip
    return out.transpose(0, 1).float(), lse.transpose(0, 1).unsqueeze(-1)


def _toggles(llm: LLM) -> dict[str, tuple[str, str, Callable[[bool], None]]]:
    """change → (label with it, label without it, set(on))."""
    key, rope, attend = metadata._prefix_key, rotary.RotaryEmbedding.forward, gather._attend
    supports, supports_rope = norm_act.supports, rotary_kernel.supports
    supports_write = attention_kernels.supports_write
    runner = llm.engine.runner
    kernel, gathering = runner.backend, GatherBackend()

    def prefix(on: bool) -> None:  # a change to the gather path, which CPUs no longer take
        runner.backend = gathering
        metadata._prefix_key = key if on else (lambda *a: ())

    def rope_step(on: bool) -> None:  # both sides in PyTorch ops, as it was measured
        rotary_kernel.supports = lambda *a: False
        rotary.RotaryEmbedding.forward = rope if on else _rope_per_layer

    def rope_kv(on: bool) -> None:
        rotary_kernel.supports = supports_rope if on else (lambda *a: False)
        attention_kernels.supports_write = supports_write if on else (lambda *a: False)

    def flash(on: bool) -> None:  # the gather path too
        runner.backend = gathering
        gather._attend = _suffix_flash if on else attend

    def in_place(on: bool) -> None:
        runner.backend = kernel if on else gathering

    def fused(on: bool) -> None:
        norm_act.supports = supports if on else (lambda x, width: False)

    quantized = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    gemm_rows = {m: m.gemm_rows for m in quantized}

    def gemm(on: bool) -> None:  # int8 tiles to 256 rows without it, as before the GEMM
        for m in quantized:
            m.gemm_rows = gemm_rows[m] if on else sys.maxsize
        if llm.engine.model.fused_decode is not None:
            llm.engine.model.fused_decode._key = None  # the C loop describes the layers again

    return {
        "prefix-reuse": ("reuse", "gather every step", prefix),
        "rope-per-step": ("per step", "per layer", rope_step),
        "suffix-flash": ("flash", "unfused", flash),
        "in-place": ("kernel reads blocks in place", "gather then attend", in_place),
        "fused-norm-act": ("fused add+RMSNorm, SiLU*up", "PyTorch ops", fused),
        "rope-kv-kernels": ("RoPE and KV write in C", "PyTorch ops", rope_kv),
        "bf16-gemm": ("bf16 GEMM above 16 rows", "int8 tiles", gemm),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    changes = ["fused-norm-act", "in-place", "kv-bf16", "prefix-reuse", "rope-per-step"]
    changes += ["repack16", "rope-kv-kernels", "suffix-flash", "bf16-gemm"]
    p.add_argument("change", choices=changes)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=64, help="decode rows (1 to 64)")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", default="none", help="as `serve --quantization`")
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization)
    engines = {True: llm.engine, False: llm.engine}
    if a.change == "kv-bf16":  # a storage dtype is fixed per engine: a second one, float32 KV
        with_it, without, switch = "KV stored in bf16", "KV stored in float32", lambda on: None
        engines[True] = LLM(
            a.model, dtype=a.dtype, kv_cache_dtype="bfloat16", quantization=a.quantization
        ).engine
        engines[False] = LLM(
            a.model, dtype=a.dtype, kv_cache_dtype="float32", quantization=a.quantization
        ).engine
    elif a.change == "repack16":  # a weight layout is fixed at load: a second engine without
        with_it, without, switch = "rows repacked by 16", "GGUF's row layout", lambda on: None
        keep, QuantWeight.repacked = QuantWeight.repacked, lambda self: self
        engines[False] = LLM(
            a.model, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization
        ).engine
        QuantWeight.repacked = keep
    else:
        with_it, without, switch = _toggles(llm)[a.change]
    kernels, levels = isa.active(), ", ".join(isa.cpu_levels())
    kv = " vs ".join(dict.fromkeys(str(e.kv_dtype) for e in engines.values()))
    print(f"model {llm.engine.dtype}, KV cache {kv}, kernels "
          f"{kernels.level if kernels else 'none'} (CPU runs {levels})")  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=64 + 10 * a.pairs, ignore_eos=True)
    for engine in set(engines.values()):
        for i, r in enumerate(edu_shared_prefix(llm.tokenizer, seed=1)[: a.batch]):
            engine.add_request(f"p{i}", r.prompt_token_ids, params)
        sched = engine.scheduler
        while sched.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in sched.running
        ):
            engine.step()
    ms: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(a.pairs):
        for on in (True, False):
            switch(on)
            engines[on].step()  # the first step after a switch pays for it (a fresh gather)
            start = time.perf_counter()
            for _ in range(4):
                engines[on].step()
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
