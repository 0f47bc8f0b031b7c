"""assess: the learner model's update for an attempt (BKT per KC, error counts) and, for a right
answer, the next problem. It only computes: the service stores the turn and this attempt in one
transaction."""

from __future__ import annotations

from dataclasses import replace

from langgraph.runtime import Runtime

from tutorserve.tutor.agents.agent import Agent, Update
from tutorserve.tutor.profile import pick_problem
from tutorserve.tutor.store import Attempt
from tutorserve.tutor.turn import Diagnosis, Turn, TurnState, TutorContext


def assess(turn: Turn, d: Diagnosis) -> Attempt | None:
    """None for a question: only an attempt at the problem moves the learner model."""
    if d["kind"] != "answer":
        return None
    right = d["correct"]
    states, changes = {}, {}
    for k in turn.problem.kcs:
        s = turn.states[k]
        after = turn.course.kc[k].bkt.params().update(s.p_mastery, right)
        states[k] = replace(
            s,
            p_mastery=after,
            attempts=s.attempts + 1,
            errors=s.errors + (0 if right else 1),
            consecutive_errors=0 if right else s.consecutive_errors + 1,
        )
        changes[k] = {"before": round(s.p_mastery, 4), "after": round(after, 4)}
    nxt = None
    if right:
        nxt = pick_problem(turn.course, {**turn.states, **states}, turn.solved | {turn.problem.id})
    return Attempt(states, changes, right, nxt.id if nxt else None)


async def run(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
    return {"attempt": assess(state["turn"], state["diagnosis"])}


AGENT = Agent(
    "assess", timeout=10.0, run=run, fallback=lambda *_: {"attempt": None}, uses_model=False
)
