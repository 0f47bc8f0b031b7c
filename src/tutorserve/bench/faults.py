"""Faults injected into a benchmark run: an engine replica's process killed mid-run
(`bench compare --kill-replica-after S`), the way a machine or a pod dies, so the report shows
what the cluster loses and what it costs in goodput.

Ray Serve names each replica's worker process after its deployment (`ray::ServeReplica:<app>:
<deployment>`), so the replica is found by its process title; the server's own process is left
alone. A system with no such process (one engine, a peer) gets no fault, and the result says so.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
_REPLICA_TITLE = b"ServeReplica:"
_DEPLOYMENTS = (b":engine", b":decode")  # replicas that serve requests (not prefill-only)


def replica_pids(proc: Path = Path("/proc")) -> list[int]:
    """The processes of this host's engine replicas, oldest first."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if _REPLICA_TITLE in title and any(d in title for d in _DEPLOYMENTS):
            found.append(int(entry.name))
    return sorted(found)


@dataclass
class ReplicaKill:
    """Kill one engine replica (SIGKILL) `after_s` seconds after `start()`."""

    after_s: float
    find: Callable[[], list[int]] = replica_pids
    killed_pid: int | None = None
    killed_at_s: float | None = None  # since start()
    _timer: threading.Timer | None = field(default=None, repr=False)
    _t0: float = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._timer = threading.Timer(self.after_s, self._kill)
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> dict:
        """Cancel the kill if it has not happened; what happened, for the result's config."""
        if self._timer is not None:
            self._timer.cancel()
        return {"kill_replica_after_s": self.after_s, "killed_pid": self.killed_pid,
                "killed_at_s": self.killed_at_s}  # fmt: skip

    def _kill(self) -> None:
        pids = self.find()
        if not pids:
            log.warning("no engine replica process to kill: this system runs no Ray replicas")
            return
        pid = pids[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            log.warning("replica process %d was already gone", pid)
            return
        self.killed_pid, self.killed_at_s = pid, time.monotonic() - self._t0
        log.info("killed engine replica process %d at %.1f s", pid, self.killed_at_s)
