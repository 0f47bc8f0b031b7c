"""What an agent is: a name, a time limit, its work, and the authored fallback used when the work
fails or is late, so a slow or failing model call costs the student a template reply, never a
stalled turn. Each run is one OpenTelemetry span and one timing record."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from langgraph.runtime import Runtime

from tutorserve.tutor.turn import TurnState, TutorContext

log = logging.getLogger(__name__)

Update = dict[str, Any]  # the state keys an agent writes
Run = Callable[[TurnState, Runtime[TutorContext]], Awaitable[Update]]
Fallback = Callable[[TurnState, Runtime[TutorContext]], Update]
Node = Callable[[TurnState, Runtime[TutorContext]], Awaitable[Update]]


@dataclass(frozen=True, slots=True)
class Agent:
    name: str
    timeout: float  # seconds by default; the service may set others per agent
    run: Run
    fallback: Fallback
    critical: bool = True  # the student waits for it (it runs before the final event)
    # Extra seconds before the graph gives up on an agent that keeps its own deadline (explain
    # does, to keep what the student already saw).
    grace: float = 0.0

    def node(self) -> Node:
        """The LangGraph node: the run under a span and a timeout, the fallback on failure."""

        async def node(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
            turn, services = state["turn"], runtime.context
            start = time.monotonic()
            with services.tracer.start_as_current_span(
                f"tutor.{self.name}",
                context=services.trace_parent,
                attributes={"tutor.session": turn.session_id, "tutor.problem": turn.problem.id},
            ) as span:
                try:
                    limit = services.timeouts[self.name] + self.grace
                    out = await asyncio.wait_for(self.run(state, runtime), limit)
                    used = []
                except Exception as e:  # a timeout or a failed model call: the turn goes on
                    reason = "timeout" if isinstance(e, TimeoutError) else type(e).__name__
                    log.warning("tutor %s fell back (%s: %s)", self.name, reason, e)
                    span.set_attribute("tutor.fallback", reason)
                    out, used = self.fallback(state, runtime), [self.name]
            t0 = turn.started
            step = {"start_ms": (start - t0) * 1e3, "end_ms": (time.monotonic() - t0) * 1e3}
            return {**out, "steps": {self.name: step}, "fallbacks": out.get("fallbacks", []) + used}

        return node
