"""Per-tenant (school) quotas: turns and model tokens per minute and per day. A tenant beyond
its quota is refused (HTTP 429 with Retry-After) or served from a cheaper tier, as its limits
say. Counts are this server's own (replicas do not share them).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from tutorserve.tutor.tiers import Tier

_WINDOWS = {"minute": 60.0, "day": 86_400.0}


class OverQuota(Enum):
    REFUSE = "refuse"  # 429 with Retry-After
    DEGRADE = "degrade"  # the turn runs on `Limits.degrade_to` at most


@dataclass(frozen=True, slots=True)
class Limits:
    """None: no limit of that kind."""

    turns_per_minute: int | None = None
    turns_per_day: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    over: OverQuota = OverQuota.REFUSE
    degrade_to: Tier = Tier.AUTHORED
    # The engine's request priority for the school's model calls (lower first, as in vLLM):
    # an exam-week class at -1 is scheduled before everyone at 0.
    priority: int = 0

    def __post_init__(self) -> None:
        caps = (self.turns_per_minute, self.turns_per_day, self.tokens_per_minute,
                self.tokens_per_day)  # fmt: skip
        if any(c is not None and c < 1 for c in caps):
            raise ValueError("quota limits must be at least 1 (or absent)")


class QuotaExceeded(Exception):
    def __init__(self, tenant: str, what: str, retry_after: int) -> None:
        super().__init__(f"school {tenant!r} is over its quota of {what}; retry in {retry_after} s")
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Admission:
    cap: Tier = Tier.LARGE  # the highest tier the turn may use
    priority: int = 0


class Quotas:
    """Fixed windows (this minute, this day) of turns and tokens per tenant."""

    def __init__(
        self,
        limits: Mapping[str, Limits],
        default: Limits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.limits = dict(limits)
        self.default = default
        self.clock = clock
        self._used: dict[tuple[str, str, str, int], int] = {}  # (tenant, kind, window, index)
        self._lock = threading.Lock()
        self.refused = 0
        self.degraded = 0

    def _count(self, tenant: str, kind: str, window: str, now: float) -> int:
        return self._used.get((tenant, kind, window, int(now // _WINDOWS[window])), 0)

    def admit(self, tenant: str) -> Admission:
        """Count a turn for `tenant`, or raise QuotaExceeded (refusing limits)."""
        limits = self.limits.get(tenant, self.default)
        if limits is None:
            return Admission()
        now = self.clock()
        with self._lock:
            over = self._over(tenant, limits, now)
            if over is not None and limits.over is OverQuota.REFUSE:
                self.refused += 1
                what, window = over
                size = _WINDOWS[window]
                raise QuotaExceeded(tenant, what, max(1, math.ceil(size - now % size)))
            self._add(tenant, "turns", 1, now)
            if over is not None:
                self.degraded += 1
                return Admission(limits.degrade_to, limits.priority)
            return Admission(Tier.LARGE, limits.priority)

    def _over(self, tenant: str, limits: Limits, now: float) -> tuple[str, str] | None:
        for kind, window, cap in (
            ("turns", "minute", limits.turns_per_minute),
            ("turns", "day", limits.turns_per_day),
            ("tokens", "minute", limits.tokens_per_minute),
            ("tokens", "day", limits.tokens_per_day),
        ):
            if cap is not None and self._count(tenant, kind, window, now) >= cap:
                return f"{cap} {kind} per {window}", window
        return None

    def charge(self, tenant: str, tokens: int) -> None:
        """Model tokens a turn of `tenant` spent (known once it is done)."""
        with self._lock:
            self._add(tenant, "tokens", tokens, self.clock())

    def _add(self, tenant: str, kind: str, n: int, now: float) -> None:
        current = {w: int(now // size) for w, size in _WINDOWS.items()}
        for window, index in current.items():
            key = (tenant, kind, window, index)
            self._used[key] = self._used.get(key, 0) + n
        if len(self._used) > 4 * len(current) * max(1, len(self.limits)) + 1024:
            # Past windows never count again.
            self._used = {k: v for k, v in self._used.items() if k[3] == current[k[2]]}
