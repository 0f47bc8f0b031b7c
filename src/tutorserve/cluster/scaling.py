"""How many engine replicas: a fixed number (`--replicas N`) or a range that Ray Serve's
autoscaler moves in (`--min-replicas`, `--max-replicas`), on queue depth.

Serve scales on ongoing requests per replica: those routed to it and not ended. A replica takes
every request Serve routes to it (admission is the ingress's), so that count is the engine's
running batch plus its waiting queue, the queue depth. The target defaults to the engine's batch
(`--max-num-seqs`): a replica whose requests no longer fit one batch has a queue, and another
replica would serve the queued ones at once.

With prefill/decode disaggregation (`--prefill-replicas P --decode-replicas D`), P replicas only
compute prompts and D replicas continue the requests, the prompts' blocks moving between them
through the shared disk tier (`disagg.py`): both sizes are fixed.

Plain Python (no Ray), so the CLI can check the options before anything starts.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

from tutorserve.config import EngineConfig


@dataclass(frozen=True, slots=True)
class Scale:
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float | None = None  # None: a fixed size
    prefill_replicas: int = 0  # disaggregated: the replicas above decode, these prefill

    @property
    def elastic(self) -> bool:
        return self.target_ongoing_requests is not None

    @property
    def most_engines(self) -> int:
        """The most engine replicas this cluster may run at once, prefill ones included."""
        return self.max_replicas + self.prefill_replicas

    def deployment_options(self) -> dict[str, Any]:
        """The replica count in Serve's deployment options."""
        if not self.elastic:
            return {"num_replicas": self.min_replicas}
        return {
            "autoscaling_config": {
                "min_replicas": self.min_replicas,
                "initial_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        }

    def describe(self) -> str:
        if self.prefill_replicas:
            return f"{self.prefill_replicas} prefill and {self.min_replicas} decode replicas"
        if not self.elastic:
            return f"{self.min_replicas} engine replicas"
        return (f"{self.min_replicas} to {self.max_replicas} engine replicas (autoscaling at "
                f"{self.target_ongoing_requests:g} requests per replica)")  # fmt: skip


def add_scaling_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="engines on Ray Serve behind our router (0: one engine in this process)",
    )
    group.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="with --max-replicas: autoscale from this many engines (default 1)",
    )
    group.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="autoscale up to this many engines on Ray Serve's autoscaler",
    )
    group.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling target: requests running or queued per replica "
        "(default: --max-num-seqs, one engine batch)",
    )
    group.add_argument(
        "--prefill-replicas",
        type=int,
        default=None,
        help="with --decode-replicas: engines that only compute prompts, whose KV blocks move "
        "to a decode engine through the shared --kv-disk-dir",
    )
    group.add_argument(
        "--decode-replicas",
        type=int,
        default=None,
        help="with --prefill-replicas: engines that continue the prefilled requests",
    )


def scale_from_args(a: argparse.Namespace, batch: int) -> Scale | None:
    """The cluster's size from the options, or None for one engine in this process; ValueError
    for options that contradict each other."""
    autoscale = a.min_replicas is not None or a.max_replicas is not None
    if a.prefill_replicas is not None or a.decode_replicas is not None:
        return _disaggregated(a, autoscale)
    if a.replicas and autoscale:
        raise ValueError("give --replicas N (a fixed size) or --min/--max-replicas, not both")
    if a.replicas < 0:
        raise ValueError(f"--replicas must be at least 1, got {a.replicas}")
    if not autoscale:
        if a.target_ongoing_requests is not None:
            raise ValueError("--target-ongoing-requests needs --max-replicas")
        return Scale(a.replicas, a.replicas) if a.replicas else None
    if a.max_replicas is None:
        raise ValueError("--min-replicas needs --max-replicas")
    low = 1 if a.min_replicas is None else a.min_replicas
    # At least one replica stays up: the ingress reads the model's facts from one at start.
    if not 1 <= low <= a.max_replicas:
        raise ValueError(
            f"need 1 <= --min-replicas <= --max-replicas, got {low} and {a.max_replicas}"
        )
    target = batch if a.target_ongoing_requests is None else a.target_ongoing_requests
    if target <= 0:
        raise ValueError(f"--target-ongoing-requests must be positive, got {target}")
    return Scale(low, a.max_replicas, target)


def _disaggregated(a: argparse.Namespace, autoscale: bool) -> Scale:
    if a.prefill_replicas is None or a.decode_replicas is None:
        raise ValueError("--prefill-replicas and --decode-replicas go together: give both")
    if autoscale or a.target_ongoing_requests is not None:
        raise ValueError("--prefill-replicas/--decode-replicas are fixed sizes: "
                         "no --min/--max-replicas or --target-ongoing-requests")  # fmt: skip
    if a.replicas:
        raise ValueError("give --replicas N or --prefill-replicas/--decode-replicas, not both")
    if a.prefill_replicas < 1 or a.decode_replicas < 1:
        raise ValueError(f"--prefill-replicas and --decode-replicas must be at least 1, got "
                         f"{a.prefill_replicas} and {a.decode_replicas}")  # fmt: skip
    # The blocks move through the disk tier: it must be on, in a folder every replica sees. On
    # this host's own Ray instance the default folder is one; across the hosts of a cluster
    # joined by address it must be named on purpose (a shared filesystem).
    if not a.kv_disk_bytes:
        raise ValueError("prefill/decode disaggregation moves KV blocks through the disk tier: "
                         "give a nonzero --kv-disk-gb")  # fmt: skip
    default_dir = next(f.default for f in fields(EngineConfig) if f.name == "kv_disk_dir")
    named = a.kv_disk_dir != default_dir or os.environ.get("TUTORSERVE_KV_DIR")
    if (a.ray_address or os.environ.get("RAY_ADDRESS")) and not named:
        raise ValueError("on a Ray cluster, prefill/decode disaggregation needs the disk tier in "
                         "a folder every replica sees: give --kv-disk-dir")  # fmt: skip
    return Scale(a.decode_replicas, a.decode_replicas, prefill_replicas=a.prefill_replicas)
