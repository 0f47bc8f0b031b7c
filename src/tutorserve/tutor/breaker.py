"""A circuit breaker per model endpoint: when too many recent calls failed or were too slow, the
endpoint is skipped at once (the next tier down answers) instead of every agent waiting for its
own timeout; after a pause, one probe call at a time tests whether it recovered. The probe is
not a student's call (`Routing` sends it on the side), so nobody waits on an endpoint that may
still be down."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class State(Enum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are refused until `open_s` has passed
    HALF_OPEN = "half_open"  # one probe at a time; its outcome closes or reopens


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    window_s: float = 30.0  # outcomes older than this are forgotten
    min_calls: int = 3  # no verdict on fewer calls than this in the window
    failure_rate: float = 0.5  # failed or slow share of the window's calls that opens it
    # A call whose first token takes longer counts as failed: well above a busy CPU engine's
    # first token (`bench tutor` measured explain medians of 9 s at 8 sessions).
    slow_s: float = 30.0
    open_s: float = 10.0  # how long it stays open before a probe

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and self.slow_s > 0 and self.open_s > 0):
            raise ValueError("breaker window, slow and open times must be positive seconds")
        if self.min_calls < 1 or not 0 < self.failure_rate <= 1:
            raise ValueError("breaker min_calls must be ≥ 1 and failure_rate in (0, 1]")


class CircuitBreaker:
    def __init__(
        self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or BreakerConfig()
        self.clock = clock
        self.state = State.CLOSED
        self._outcomes: deque[tuple[float, bool]] = deque()  # (when, failed)
        self._opened_at = 0.0
        self._probing = False
        self.opened = 0  # times it opened, for metrics

    def allow(self) -> bool:
        """Whether a call may go to the endpoint now."""
        self._tick()
        return self.state is State.CLOSED

    def take_probe(self) -> bool:
        """Whether to probe the endpoint now: once per half-open spell, until `record` says
        how the probe went."""
        self._tick()
        if self.state is State.HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    def record(self, failed: bool) -> None:
        now = self.clock()
        if self.state is State.HALF_OPEN:
            self._probing = False
            if failed:
                self._open(now)
            else:
                self.state = State.CLOSED
                self._outcomes.clear()
            return
        self._outcomes.append((now, failed))
        while self._outcomes and now - self._outcomes[0][0] > self.config.window_s:
            self._outcomes.popleft()
        n = len(self._outcomes)
        bad = sum(f for _, f in self._outcomes)
        if n >= self.config.min_calls and bad / n >= self.config.failure_rate:
            self._open(now)

    def _tick(self) -> None:
        if self.state is State.OPEN and self.clock() - self._opened_at >= self.config.open_s:
            self.state, self._probing = State.HALF_OPEN, False

    def _open(self, now: float) -> None:
        self.state, self._opened_at = State.OPEN, now
        self._outcomes.clear()
        self.opened += 1

    def snapshot(self) -> dict[str, object]:
        self._tick()  # an open breaker past its pause shows as half-open
        window = list(self._outcomes)
        return {
            "state": self.state.value,
            "calls_in_window": len(window),
            "failures_in_window": sum(f for _, f in window),
            "times_opened": self.opened,
        }
