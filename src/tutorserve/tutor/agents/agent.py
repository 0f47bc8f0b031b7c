"""What an agent is: a name, a time limit, its work, and the authored fallback used when the work
fails or is late, so a slow or failing model call costs the student a template reply, never a
stalled turn. Each run is one OpenTelemetry span (with its model calls' tokens), one timing
record, the tier that wrote its text, and its model calls for cost attribution."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from langgraph.runtime import Runtime

from tutorserve.tutor.costs import open_log, span_attributes
from tutorserve.tutor.reply_cache import ReplyKey, course_version
from tutorserve.tutor.turn import Turn, TurnState, TutorContext

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
    uses_model: bool = True  # False: plain code, its tier is "code"

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
                calls = open_log(self.name)
                try:
                    limit = services.timeouts[self.name] + self.grace
                    out = await asyncio.wait_for(self.run(state, runtime), limit)
                    used = []
                except Exception as e:  # a timeout or a failed model call: the turn goes on
                    reason = "timeout" if isinstance(e, TimeoutError) else type(e).__name__
                    log.warning("tutor %s fell back (%s: %s)", self.name, reason, e)
                    span.set_attribute("tutor.fallback", reason)
                    out, used = self.fallback(state, runtime), [self.name]
                span.set_attributes(span_attributes(calls.calls))
            t0 = turn.started
            step = {"start_ms": (start - t0) * 1e3, "end_ms": (time.monotonic() - t0) * 1e3}
            fallbacks = out.get("fallbacks", []) + used
            if not self.uses_model:
                tier = "code"
            elif self.name in fallbacks or not calls.calls:
                tier = "authored"
            else:
                last = calls.calls[-1]
                tier = "cache" if last.cached_reply else last.tier.label
            return {**out, "steps": {self.name: step}, "fallbacks": fallbacks,
                    "tiers": {self.name: tier}, "calls": calls.calls}  # fmt: skip

        return node


def reply_key(
    agent: str, turn: Turn, rung: int, label: str, model: str, said: str = ""
) -> ReplyKey:
    """The reply cache's key for an agent call on this turn's problem."""
    course, kcs = turn.course, turn.problem.kcs
    return ReplyKey(
        agent=agent,
        course=course.id,
        course_version=course_version(course),
        problem=turn.problem.id,
        kc=",".join(kcs),
        rung=rung,
        label=label,
        cefr=turn.cefr,
        model=model,
        said=said,
    )
