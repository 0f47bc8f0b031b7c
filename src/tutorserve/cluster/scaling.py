"""How many engine replicas: a fixed number (`--replicas N`) or a range that Ray Serve's
autoscaler moves in (`--min-replicas`, `--max-replicas`), on queue depth.

Serve scales on ongoing requests per replica: those routed to it and not ended. A replica takes
every request Serve routes to it (admission is the ingress's), so that count is the engine's
running batch plus its waiting queue, the queue depth. The target defaults to the engine's batch
(`--max-num-seqs`): a replica whose requests no longer fit one batch has a queue, and another
replica would serve the queued ones at once. Plain Python (no Ray), so the CLI can check the
options before anything starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Scale:
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float | None = None  # None: a fixed size

    @property
    def elastic(self) -> bool:
        return self.target_ongoing_requests is not None

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


def scale_from_args(a: argparse.Namespace, batch: int) -> Scale | None:
    """The cluster's size from the options, or None for one engine in this process; ValueError
    for options that contradict each other."""
    autoscale = a.min_replicas is not None or a.max_replicas is not None
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
