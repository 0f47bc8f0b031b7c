"""Hedged model calls: when a model's first token is later than that model usually takes, the
same call is also sent one tier down, and whichever answers first writes the reply ("The Tail
at Scale": hedge after the 95th percentile). The breaker alone cannot do this for the calls in
flight when a model starts to hang: each waits `slow_s` before it counts as failed.

An `Attempt` is one model's try at a call. It runs in a context of its own, so the tokens its
client reports are charged to its own `Call` even while a hedge runs beside it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tutorserve.tutor.costs import Call, begin_call, charging
from tutorserve.tutor.llm_client import ChatLLM, Messages
from tutorserve.tutor.tiers import Tier


@dataclass(frozen=True, slots=True)
class HedgeConfig:
    # Until an endpoint has `min_samples` first tokens on record: the wait before hedging. A
    # busy CPU engine's first token takes seconds (`bench tutor`: explain medians of 9 s at 8
    # sessions), so this is well above a healthy engine's usual one.
    after_s: float = 10.0
    quantile: float = 0.95  # then: this quantile of its recent first-token latencies
    min_samples: int = 20
    window: int = 256  # first-token latencies kept per endpoint

    def __post_init__(self) -> None:
        if not (self.after_s > 0 and 0 < self.quantile < 1):
            raise ValueError("hedge after_s must be positive seconds and quantile in (0, 1)")
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ValueError("hedge min_samples must be ≥ 1 and window ≥ min_samples")


class FirstTokenLatency:
    """One endpoint's recent first-token latencies, and how long to wait before hedging it."""

    def __init__(self, config: HedgeConfig) -> None:
        self.config = config
        self._seen: deque[float] = deque(maxlen=config.window)
        self.hedged = 0  # its calls that were hedged
        self.hedges_won = 0  # of those, the ones the hedge answered first

    def observe(self, seconds: float) -> None:
        self._seen.append(seconds)

    def hedge_after(self) -> float:
        if len(self._seen) < self.config.min_samples:
            return self.config.after_s
        ordered = sorted(self._seen)
        return ordered[min(len(ordered) - 1, int(self.config.quantile * len(ordered)))]


class Attempt:
    """One model's try at a call: `first()` starts it and waits for its first delta (None: the
    reply was empty); `rest()` streams the others; `close()` aborts it (the engine frees its
    KV blocks) and charges its wall time, up to `abandon()` if it was abandoned."""

    def __init__(self, tier: Tier, llm: ChatLLM, messages: Messages, kw: dict[str, Any]) -> None:
        self.tier, self.llm = tier, llm
        self.call: Call | None = begin_call(tier, llm.name)
        self._context = charging(self.call)
        self._deltas: AsyncIterator[str] = self._context.run(llm.stream, messages, **kw)
        self.started = time.monotonic()
        self._abandoned_at: float | None = None
        self.first_task = self._pending = self._step()

    def _step(self) -> asyncio.Task[str | None]:
        async def step() -> str | None:
            try:
                return await anext(self._deltas)
            except StopAsyncIteration:
                return None

        self._pending = asyncio.get_running_loop().create_task(step(), context=self._context)
        return self._pending

    async def rest(self) -> AsyncIterator[str]:
        while (delta := await self._step()) is not None:
            yield delta

    def abandon(self) -> None:
        """Its reply will not be used: its model time ends here, whenever it is closed."""
        self._abandoned_at = self._abandoned_at or time.monotonic()

    async def close(self) -> None:
        # The step in flight must end before the stream can be closed (an async generator
        # cannot be closed while it runs); cancelling it aborts the model's request.
        self._pending.cancel()
        await asyncio.wait([self._pending])
        closing = asyncio.get_running_loop().create_task(
            self._deltas.aclose(),  # type: ignore[attr-defined]
            context=self._context,
        )
        try:
            await asyncio.shield(closing)
        finally:
            if self.call is not None:
                self.call.seconds = (self._abandoned_at or time.monotonic()) - self.started
