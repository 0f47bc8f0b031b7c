"""One tutoring turn as LangGraph sees it: the state is typed data only (what the turn read, what
each agent wrote), and the services the agents call through (the chat model, the retriever, the
tracer, the timeouts, the model routing) are the run's context, LangGraph's `Runtime.context`,
never state.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Literal, TypedDict

from opentelemetry.context import Context
from opentelemetry.trace import Tracer

from tutorserve.tutor.costs import Call
from tutorserve.tutor.courses import Course, Problem
from tutorserve.tutor.routing import Routing
from tutorserve.tutor.store import Attempt, KCState
from tutorserve.tutor.tiers import Situation, Tier


@dataclass(frozen=True, slots=True)
class Turn:
    """Everything a turn reads, loaded before it starts; no agent changes it."""

    course: Course
    problem: Problem
    session_id: str
    learner_id: str
    message: str
    history: tuple[tuple[str, str], ...]
    states: Mapping[str, KCState]
    solved: frozenset[str]
    started: float  # time.monotonic() when the turn began; step times are relative to it
    tenant: str = "default"  # the school the learner belongs to, charged for the turn
    cap: Tier = Tier.LARGE  # the highest model tier the turn may use (lower: over quota)
    priority: int = 0  # the engine's request priority for its model calls (lower first)

    @property
    def cefr(self) -> str:
        """The highest CEFR level of the problem's KCs ("" for a course without levels)."""
        return max((c for k in self.problem.kcs if (c := self.course.kc[k].cefr)), default="")

    def situation(self, agent: str, rung: int, wrong: bool = False) -> Situation:
        """The learner's state as the tiering policy sees it; `wrong`: this turn's answer was."""
        kcs = self.problem.kcs
        streak = max(self.states[k].consecutive_errors for k in kcs) + int(wrong)
        mastery = min(self.states[k].p_mastery for k in kcs)
        return Situation(agent, rung, mastery, streak, self.cefr)


class Diagnosis(TypedDict):
    kind: Literal["answer", "help"]
    correct: bool
    level: int  # the Socratic ladder rung the reply is written for
    label: str
    reason: str
    source: Literal["code", "authored", "model"]


class Step(TypedDict):
    start_ms: float
    end_ms: float


def _merge(a: dict, b: dict) -> dict:
    return {**a, **b}


class TurnState(TypedDict, total=False):
    turn: Turn
    diagnosis: Diagnosis
    material: list[str]
    reply: str
    attempt: Attempt | None  # None: nothing to record (a question, or assess failed)
    engage: str
    steps: Annotated[dict[str, Step], _merge]
    fallbacks: Annotated[list[str], operator.add]
    tiers: Annotated[dict[str, str], _merge]  # per agent: what wrote its text (tier or "code")
    calls: Annotated[list[Call], operator.add]  # model calls and reply-cache hits, for costs


Retriever = Callable[[Turn], list[str]]


@dataclass(frozen=True, slots=True)
class TutorContext:
    """The services of one turn's run, passed as LangGraph's runtime context."""

    routing: Routing
    retriever: Retriever  # plain code that may block (a search index): called in a thread
    timeouts: Mapping[str, float]  # seconds per agent name
    tracer: Tracer
    trace_parent: Context | None = None  # the turn's span, so agents' spans nest under it
