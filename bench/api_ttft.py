"""TTFT of single requests at idle: the engine alone against the same engine behind the HTTP API.

    .venv/bin/python bench/api_ttft.py

The first 10 prompts of `edu-shared-prefix`, sent one at a time as token ids: the first (a
warm-up), 7 more of other courses (computed whole), then 2 whose course prompt is cached; through
`LLM.generate` (max_tokens 1), then through `tutorserve serve` as `bench compare` starts its
`tutorserve-notiers` system (`/v1/completions`, streamed, to its first text chunk). Says whether
the serving path adds time to a request by itself, or only under load
(docs/benchmarks/planner.md).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tutorserve import LLM, SamplingParams
from tutorserve.bench.systems import ModelFiles, RunningServer, ServeSpec, tutorserve_server
from tutorserve.bench.workloads import edu_shared_prefix
from tutorserve.models.loader import load_tokenizer
from tutorserve.models.registry import resolve

MODEL, PORT = "smollm2-135m-instruct", 8123
_WHOLE = 7  # after the warm-up, prompts of courses not seen yet (8 courses in the workload)


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
    files = ModelFiles(MODEL, str(resolve(MODEL)), hf_dir="")  # only peers read the HF export
    system = tutorserve_server("tutorserve-notiers", ServeSpec(files, PORT, 32), tiers=False)
    log = Path(tempfile.mkdtemp(prefix="api-ttft-")) / "server.log"
    with RunningServer(system, PORT, log):
        return [_api_ttft(ids) for ids in prompts]


def main() -> None:
    prompts = [r.prompt_token_ids for r in edu_shared_prefix(load_tokenizer(MODEL), seed=1)[:10]]
    for name, measure in (("engine alone", _engine_ttfts), ("HTTP API", _api_ttfts)):
        ttfts = measure(prompts)
        ms = [round(1000 * t) for t in ttfts[1:]]  # the first is the warm-up
        whole, cached = ms[:_WHOLE], ms[_WHOLE:]
        print(f"{name}: TTFT ms {ms}; median of the whole prompts {statistics.median(whole)}, "
              f"of the cached {statistics.median(cached)}")  # fmt: skip


if __name__ == "__main__":
    main()
