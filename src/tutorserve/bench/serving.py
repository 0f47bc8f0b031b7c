"""`tutorserve bench serve`: one workload against one running server, summarized."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict
from typing import Any

from tutorserve.bench.arrivals import arrival_times
from tutorserve.bench.client import ClientConfig, run_sessions, scrape_counters
from tutorserve.bench.serving_metrics import SLO, summarize
from tutorserve.bench.workloads import serving_workload
from tutorserve.models.tokenizer import Tokenizer


def run_benchmark(
    cfg: ClientConfig,
    tok: Tokenizer,
    *,
    workload: str,
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    arrival: str = "gamma",
    slo: SLO | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the workload; the result holds its config, the summary and every request's trace."""
    slo = slo or SLO()
    sessions = serving_workload(tok, workload, num_requests, seed)
    # Arrivals are per session: a multi-turn session's later turns follow its own think time.
    starts = arrival_times(
        len(sessions), request_rate, burstiness=burstiness, profile=arrival, seed=seed
    )
    before = scrape_counters(cfg.base_url)
    records, duration = asyncio.run(run_sessions(cfg, sessions, starts, tok))
    after = scrape_counters(cfg.base_url)
    summary = summarize(records, duration, slo) if duration > 0 else {"completed": 0}
    summary |= server_counts(before, after)
    return {
        "config": {
            "base_url": cfg.base_url,
            "model": cfg.model,
            "workload": workload,
            "num_requests": num_requests,
            "request_rate": request_rate if math.isfinite(request_rate) else "inf",
            "burstiness": burstiness,
            "arrival": arrival,
            "max_concurrency": cfg.max_concurrency,
            "slo_ttft_ms": slo.ttft_ms,
            "slo_tpot_ms": slo.tpot_ms,
            "seed": seed,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "summary": summary,
        "records": [asdict(r) for r in records],
    }


def server_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server's counters say of the run between two scrapes: its prefix-cache hit
    rate, the tokens it drafted and accepted (speculative decoding), the requests it preempted,
    and its engines' steps and mean step time, where it counts them."""
    d = {k: after[k] - before[k] for k in after if k in before}
    out = {}
    if d.get("prefix_cache_queries_total", 0) > 0 and "prefix_cache_hits_total" in d:
        out["server_prefix_cache_hit_rate"] = (
            d["prefix_cache_hits_total"] / d["prefix_cache_queries_total"]
        )
    drafted = d.get("spec_decode_num_draft_tokens_total", 0)
    if drafted > 0 and "spec_decode_num_accepted_tokens_total" in d:
        accepted = d["spec_decode_num_accepted_tokens_total"]
        out |= {"spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
                "spec_acceptance_rate": accepted / drafted}  # fmt: skip
    if "num_preemptions_total" in d:
        out["server_preemptions"] = d["num_preemptions_total"]
    steps = d.get("engine_steps_total", 0)
    if steps > 0 and "engine_step_seconds_total" in d:
        out |= {"server_engine_steps": steps,
                "server_mean_step_ms": 1000 * d["engine_step_seconds_total"] / steps}  # fmt: skip
    return out
