"""An async streaming client for any OpenAI-compatible server.

Sessions start on an arrival schedule; a session's turns follow each other after the student's
think time, each turn's prompt holding the server's own earlier answers. Every request goes to
`/v1/completions` as text already rendered through the model's chat template, so all systems
see the same tokens whatever their own template handling; greedy, with EOS ignored, so output
lengths are the workload's and not each model build's. Every content chunk is timestamped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from tutorserve.bench.serving_metrics import RequestRecord
from tutorserve.bench.workloads import Session
from tutorserve.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ClientConfig:
    base_url: str
    model: str
    api_key: str | None = None
    max_concurrency: int | None = None
    timeout_s: float = 600.0


async def run_sessions(
    cfg: ClientConfig, sessions: list[Session], starts: list[float], tok: Tokenizer
) -> tuple[list[RequestRecord], float]:
    """Run every session; returns the records and the run's duration (first send to last end)."""
    records: list[RequestRecord] = []
    gate = asyncio.Semaphore(cfg.max_concurrency or 1 << 30)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    bar = tqdm(total=sum(len(s.turns) for s in sessions), desc="requests", unit="req")
    run_id = uuid.uuid4().hex[:8]
    async with httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, timeout=cfg.timeout_s, limits=limits
    ) as client:
        t0 = time.perf_counter()

        async def session(i: int, s: Session, start: float) -> None:
            await asyncio.sleep(max(0.0, start - (time.perf_counter() - t0)))
            answers: list[str] = []
            for k, turn in enumerate(s.turns):
                if k:
                    await asyncio.sleep(turn.think_time_s)
                prompt = tok.apply_chat_template(s.messages(answers, k))
                n_prompt = len(tok.encode(prompt, add_special_tokens=False))
                async with gate:
                    rec = RequestRecord(i, k, n_prompt, time.perf_counter() - t0)
                    # Multi-turn sessions say who they are, so the server can keep their KV.
                    sid = f"bench-{run_id}-{i}" if len(s.turns) > 1 else None
                    text = await _send(
                        client, cfg.model, prompt, turn.max_tokens, rec, t0, tok, sid
                    )
                records.append(rec)
                bar.update(1)
                if rec.error is not None:
                    log.warning("session %d turn %d failed: %s", i, k, rec.error)
                    return  # later turns need this answer
                answers.append(text)

        await asyncio.gather(
            *(session(i, s, t) for i, (s, t) in enumerate(zip(sessions, starts, strict=True)))
        )
    bar.close()
    ends = [r.end for r in records if r.end is not None]
    first = min((r.start for r in records), default=0.0)
    return records, (max(ends) - first) if ends else 0.0


async def _send(
    client: httpx.AsyncClient,
    model: str,
    prompt: str,
    max_tokens: int,
    rec: RequestRecord,
    t0: float,
    tok: Tokenizer,
    session_id: str | None = None,
) -> str:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    pieces: list[str] = []
    try:
        headers = {"X-Session-Id": session_id} if session_id else None
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.error = str(data["error"])[:300]
                    return ""
                choices = data.get("choices") or []
                if choices and choices[0].get("text"):
                    rec.chunk_times.append(time.perf_counter() - t0)
                    pieces.append(choices[0]["text"])
                if usage := data.get("usage"):
                    rec.output_tokens = usage.get("completion_tokens", 0)
                    with contextlib.suppress(AttributeError, TypeError):
                        rec.cached_tokens = usage.get("prompt_tokens_details").get("cached_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return ""
    rec.end = time.perf_counter() - t0
    text = "".join(pieces)
    if not rec.output_tokens:  # the server sent no usage: count with the model's tokenizer
        rec.output_tokens = len(tok.encode(text, add_special_tokens=False))
    if not rec.chunk_times:
        rec.error = "no content streamed"
    return text


# Counters read from a server's Prometheus text before and after a run: ours and vLLM's both
# end their names so (prefix cache in tokens; speculative decoding's drafted and accepted tokens;
# requests preempted); the engine's steps and their time are ours only.
SERVER_COUNTERS = (
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    "engine_steps_total",
    "engine_step_seconds_total",
    "num_preemptions_total",
)


def scrape_counters(base_url: str) -> dict[str, float]:
    """Each of `SERVER_COUNTERS` the server offers, summed over its labels (engines, replicas);
    empty where it has no /metrics."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    except (httpx.HTTPError, ValueError):
        return {}
    found: dict[str, float] = {}
    for sample in samples:
        for key in SERVER_COUNTERS:
            if sample.name.endswith(key):
                found[key] = found.get(key, 0.0) + sample.value
    return found
