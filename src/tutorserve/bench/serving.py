"""`tutorserve bench serve`: one workload against one running server, summarized."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict
from typing import Any

from tutorserve.bench.arrivals import arrival_times
from tutorserve.bench.client import ClientConfig, run_sessions, scrape_prefix_cache
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
    before = scrape_prefix_cache(cfg.base_url)
    records, duration = asyncio.run(run_sessions(cfg, sessions, starts, tok))
    after = scrape_prefix_cache(cfg.base_url)
    summary = summarize(records, duration, slo) if duration > 0 else {"completed": 0}
    if before and after and after[0] > before[0]:
        summary["server_prefix_cache_hit_rate"] = (after[1] - before[1]) / (after[0] - before[0])
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
