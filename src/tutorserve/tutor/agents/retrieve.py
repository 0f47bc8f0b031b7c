"""retrieve: course material for the explanation, from the run's retriever (a service, so a
search index can replace the default keyword match without touching the graph)."""

from __future__ import annotations

import asyncio
import re

from langgraph.runtime import Runtime

from tutorserve.tutor.agents.agent import Agent, Update
from tutorserve.tutor.courses import KC
from tutorserve.tutor.turn import Turn, TurnState, TutorContext

_WORD = re.compile(r"[a-z]{3,}")


def course_material(turn: Turn) -> list[str]:
    """The default retriever: the problem's KC explanations, then any other KC the student's
    words point at."""
    course, problem = turn.course, turn.problem
    own = [course.kc[k] for k in problem.kcs]
    words = set(_WORD.findall(turn.message.lower()))

    def overlap(kc: KC) -> int:
        return len(words & set(_WORD.findall(f"{kc.name} {kc.explanation}".lower())))

    best = max((k for k in course.kcs if k.id not in problem.kcs), key=overlap, default=None)
    extra = [best] if best is not None and overlap(best) else []
    return [f"{k.name}: {k.explanation}" for k in own + extra]


async def run(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
    # A retriever may block (a search index); keep it off the event loop.
    return {"material": await asyncio.to_thread(runtime.context.retriever, state["turn"])}


AGENT = Agent(
    "retrieve", timeout=2.0, run=run, fallback=lambda *_: {"material": []}, uses_model=False
)
