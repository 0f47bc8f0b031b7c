"""engage: one sentence of encouragement naming the student's progress, after the final event
and off the student's wait."""

from __future__ import annotations

import re

from langgraph.runtime import Runtime

from tutorserve.tutor import prompts
from tutorserve.tutor.agents.agent import Agent, Update
from tutorserve.tutor.tiers import Tier
from tutorserve.tutor.turn import TurnState, TutorContext


def authored(state: TurnState) -> str:
    turn, attempt = state["turn"], state.get("attempt")
    states = {**turn.states, **(attempt.states if attempt else {})}
    weakest = min(turn.problem.kcs, key=lambda k: states[k].p_mastery)
    pct = round(100 * states[weakest].p_mastery)
    return f"{turn.course.kc[weakest].name}: {pct}% mastered so far. Every attempt counts."


async def run(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
    turn, attempt, routing = state["turn"], state.get("attempt"), runtime.context.routing
    tier = routing.tier(turn.situation(AGENT.name, state["diagnosis"]["level"]), turn.cap)
    if tier is Tier.AUTHORED:
        return {"engage": authored(state)}
    changes = attempt.mastery_changes if attempt else {}
    progress = ", ".join(f"{turn.course.kc[k].name}: {v['after']:.0%}" for k, v in changes.items())
    text = await routing.complete(
        tier,
        prompts.engage_messages(turn.course, turn.history, progress or "just started"),
        max_tokens=40,
        temperature=0.5,
        session_id=turn.session_id,
        priority=turn.priority,
    )
    # One sentence, or the template: a rambling model is not encouraging.
    first = re.split(r"(?<=[.!])\s", text.strip(), maxsplit=1)[0]
    fit = 10 <= len(first) <= 200 and prompts.unfit_reply(first, [turn.message]) is None
    return {"engage": first if fit else authored(state)}


AGENT = Agent(
    "engage",
    timeout=20.0,
    run=run,
    fallback=lambda state, _: {"engage": authored(state)},
    critical=False,
)
