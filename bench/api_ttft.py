"""TTFT of single requests at idle: the engine alone against the same engine behind the HTTP API.

    .venv/bin/python bench/api_ttft.py

The first 9 prompts of `edu-shared-prefix` (8 courses: 8 prompts computed whole, and one whose
course prompt is cached), sent one at a time as token ids, after one warm-up request: through
`LLM.generate` (max_tokens 1), then through `tutorserve serve` (`/v1/completions`, streamed,
to its first text chunk). Says whether the serving path adds time to a request by itself, or
only under load (docs/benchmarks/planner.md).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import httpx

from tutorserve import LLM, SamplingParams
from tutorserve.bench.workloads import edu_shared_prefix
from tutorserve.models.loader import load_tokenizer

MODEL, PORT = "smollm2-135m-instruct", 8123


def _engine_ttfts(prompts: list[list[int]]) -> list[float]:
    llm = LLM(MODEL)  # freed on return, before the server starts
    params = SamplingParams(temperature=0, max_tokens=1)
    out = []
    for ids in prompts:
        start = time.perf_counter()
        llm.generate([ids], params)
        out.append(time.perf_counter() - start)
    return out


def _api_ttft(ids: list[int]) -> float:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "stream": True}
    start = time.perf_counter()
    url = f"http://127.0.0.1:{PORT}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without text")


def _api_ttfts(prompts: list[list[int]]) -> list[float]:
    argv = [sys.executable, "-m", "tutorserve.cli", "serve", "--port", str(PORT),
            "--kv-ram-gb", "0", "--kv-disk-gb", "0"]  # fmt: skip
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(180):
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        return [_api_ttft(ids) for ids in prompts]
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    prompts = [r.prompt_token_ids for r in edu_shared_prefix(load_tokenizer(MODEL), seed=1)[:10]]
    for name, measure in (("engine alone", _engine_ttfts), ("HTTP API", _api_ttfts)):
        ttfts = measure(prompts)
        ms = [round(1000 * t) for t in ttfts[1:]]  # the first is the warm-up
        print(f"{name}: TTFT ms {ms}; median of the computed {statistics.median(ms[:-1])}, "
              f"cached {ms[-1]}")  # fmt: skip


if __name__ == "__main__":
    main()
