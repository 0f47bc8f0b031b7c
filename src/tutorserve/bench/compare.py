"""`tutorserve bench compare`: every available system, one after another, on one workload.

Each system gets its own fresh server, a warm-up (other course prompts, so its prefix cache is not
flattered), then one run per request rate; the seed of each rate is the same for every system, so
all of them see identical requests on an identical schedule.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from tutorserve.bench.client import ClientConfig
from tutorserve.bench.faults import ReplicaKill
from tutorserve.bench.registry import make_system
from tutorserve.bench.serving import run_benchmark
from tutorserve.bench.systems import ModelFiles, RunningServer, ServeSpec, host_dtype
from tutorserve.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_WARMUP_REQUESTS = 8
_WARMUP_SEED = 10_000
_WARMUP_CONCURRENCY = 4
# What regenerates a run's sessions and their send times (`sim validate` replays them).
COHORT_KEYS = ("workload", "num_requests", "request_rate", "burstiness", "arrival", "seed",
               "max_concurrency")  # fmt: skip


def cohort_of(config: dict[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in COHORT_KEYS}


def warmup_cohort(config: dict[str, Any]) -> dict[str, Any]:
    """The warm-up `run_compare` sends a server before its runs of `config`'s workload."""
    warm = {"num_requests": _WARMUP_REQUESTS, "request_rate": math.inf, "seed": _WARMUP_SEED}
    return cohort_of(config) | warm | {"max_concurrency": _WARMUP_CONCURRENCY}


def run_compare(
    systems: list[str],
    files: ModelFiles,
    tok: Tokenizer,
    rates: list[float],
    out: Path,
    *,
    port: int = 8500,
    max_num_seqs: int = 32,
    kv_cache_gb: float = 1.0,
    dtype: str = "auto",
    max_concurrency: int | None = None,
    kill_replica_after: float | None = None,  # seconds into each timed run (faults.py)
    step_logs: bool = False,  # our servers' engine steps, under out/steps/<system>
    **workload: Any,
) -> list[dict]:
    results = []
    for name in systems:
        steps = str(out / "steps" / name) if step_logs else None
        spec = ServeSpec(files, port, max_num_seqs, kv_cache_gb, dtype, step_log_dir=steps)
        system = make_system(name, spec)
        if system.missing:
            log.warning("skipping %s: not installed (%s)", name, system.missing)
            continue
        log.info("benchmarking %s", name)
        try:
            with RunningServer(system, port, out / "logs" / f"{name}.log") as server:
                cfg = ClientConfig(server.url, files.name, max_concurrency=max_concurrency)
                warm = workload | {"num_requests": _WARMUP_REQUESTS, "seed": _WARMUP_SEED}
                warmed = run_benchmark(replace(cfg, max_concurrency=_WARMUP_CONCURRENCY), tok,
                                       request_rate=math.inf, **warm)  # fmt: skip
                # What this server served before each run: its caches and router remember it,
                # so the simulator replays it before the run (`sim validate`).
                served = [cohort_of(warmed["config"])]
                for k, rate in enumerate(rates):
                    # A fresh cohort per rate, or later rates would hit earlier rates' prompts.
                    cohort = workload | {"seed": workload["seed"] + k}
                    fault = None if kill_replica_after is None else ReplicaKill(kill_replica_after)
                    if fault is not None:
                        fault.start()
                    try:
                        result = run_benchmark(cfg, tok, request_rate=rate, **cohort)
                    finally:
                        injected = None if fault is None else fault.stop()
                    result["config"] |= {
                        "system": name, "argv": system.argv, "env": system.env,
                        "dtype": host_dtype(dtype), "fault": injected, "served_before": served,
                    }  # fmt: skip
                    served = [*served, cohort_of(result["config"])]
                    path = out / f"{workload['workload']}-{name}-rate{rate:g}.json"
                    path.write_text(json.dumps(result, indent=1))
                    results.append(result)
        except RuntimeError as e:
            log.error("%s failed: %s", name, e)
    return results
