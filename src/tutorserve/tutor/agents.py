"""The plain-code parts of the tutoring agents, and the authored fallbacks the graph uses when a
model call is slow or fails: judging the answer, retrieving course material, updating the learner
model, and choosing the next problem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context

from tutorserve.tutor.answers import is_correct, matches
from tutorserve.tutor.courses import KC, Course, Problem
from tutorserve.tutor.ladder import ladder_level, message_kind
from tutorserve.tutor.llm_client import ChatLLM
from tutorserve.tutor.profile import MASTERED
from tutorserve.tutor.store import KCState, TutorStore

_WORD = re.compile(r"[a-z]{3,}")


@dataclass(slots=True)
class TurnContext:
    """Everything one turn reads; the graph's nodes share it, and only `assess` writes."""

    course: Course
    problem: Problem
    session_id: str
    learner_id: str
    message: str
    history: list[tuple[str, str]]
    states: dict[str, KCState]
    solved: set[str]
    llm: ChatLLM
    store: TutorStore
    timeouts: Any  # graph.Timeouts
    started: float
    trace_parent: Context | None = None


def kc_states(course: Course, stored: dict[str, KCState]) -> dict[str, KCState]:
    """Every KC's state, starting unseen ones at their prior."""
    return {k.id: stored.get(k.id) or KCState(p_mastery=k.bkt.prior) for k in course.kcs}


def judge(ctx: TurnContext) -> dict[str, Any]:
    """Right or wrong, by code; the ladder level; an authored diagnosis for a known mistake."""
    p = ctx.problem
    kind = message_kind(ctx.message, p)
    correct = kind == "answer" and is_correct(ctx.message, p)
    streak = max(ctx.states[k].consecutive_errors for k in p.kcs)
    d: dict[str, Any] = {
        "kind": kind,
        "correct": correct,
        "level": ladder_level(correct, kind, streak),
        "label": "correct" if correct else ("help-request" if kind == "help" else "unclassified"),
        "reason": "",
        "source": "code",
    }
    if kind == "answer" and not correct:
        for m in p.misconceptions:
            if matches(ctx.message, [m.answer], p.answer_type):
                d |= {"label": "misconception", "reason": m.diagnosis, "source": "authored"}
                break
    return d


def retrieve_material(ctx: TurnContext) -> list[str]:
    """The problem's KC explanations, then any other KC the student's words point at."""
    own = [ctx.course.kc[k] for k in ctx.problem.kcs]
    words = set(_WORD.findall(ctx.message.lower()))

    def overlap(kc: KC) -> int:
        return len(words & set(_WORD.findall(f"{kc.name} {kc.explanation}".lower())))

    best = max(
        (k for k in ctx.course.kcs if k.id not in ctx.problem.kcs), key=overlap, default=None
    )
    extra = [best] if best is not None and overlap(best) else []
    return [f"{k.name}: {k.explanation}" for k in own + extra]


def verdict(d: dict[str, Any]) -> str:
    """How the reply opens, decided by code: a right or wrong answer, or nothing for a question."""
    if d["kind"] != "answer":
        return ""
    return "Correct! " if d["correct"] else "Not quite. "


def explain_fallback(ctx: TurnContext, d: dict[str, Any]) -> str:
    p, level = ctx.problem, d["level"]
    if level == 0:
        return f"The answer is {p.answer}."
    if level == 3:
        return p.correction
    return p.hints[level - 1]


def engage_fallback(ctx: TurnContext) -> str:
    weakest = min(ctx.problem.kcs, key=lambda k: ctx.states[k].p_mastery)
    pct = round(100 * ctx.states[weakest].p_mastery)
    return f"{ctx.course.kc[weakest].name}: {pct}% mastered so far. Every attempt counts."


def pick_problem(course: Course, states: dict[str, KCState], solved: set[str]) -> Problem | None:
    """The first unsolved problem, in authored order, that still exercises an unmastered KC;
    else the first unsolved one; None once everything is solved."""
    unsolved = [p for p in course.problems if p.id not in solved]
    for p in unsolved:
        if any(states[k].p_mastery < MASTERED for k in p.kcs):
            return p
    return unsolved[0] if unsolved else None


def assess_answer(ctx: TurnContext, d: dict[str, Any]) -> dict[str, Any]:
    """Update BKT and error counts for an attempt, persist them, and move on when it was right."""
    if d["kind"] != "answer":
        return {"mastery_changes": {}, "next_problem": None}
    changes = {}
    for k in ctx.problem.kcs:
        s = ctx.states[k]
        before = s.p_mastery
        s.p_mastery = ctx.course.kc[k].bkt.params().update(before, d["correct"])
        s.attempts += 1
        s.errors += 0 if d["correct"] else 1
        s.consecutive_errors = 0 if d["correct"] else s.consecutive_errors + 1
        changes[k] = {"before": round(before, 4), "after": round(s.p_mastery, 4)}
    ctx.store.save_mastery(
        ctx.learner_id, ctx.course.id, {k: ctx.states[k] for k in ctx.problem.kcs}
    )
    nxt = None
    if d["correct"]:
        ctx.store.mark_solved(ctx.learner_id, ctx.course.id, ctx.problem.id)
        ctx.solved.add(ctx.problem.id)
        nxt = pick_problem(ctx.course, ctx.states, ctx.solved)
        ctx.store.set_problem(ctx.session_id, nxt.id if nxt else None)
    return {"mastery_changes": changes, "next_problem": problem_view(nxt) if nxt else None}


def problem_view(p: Problem) -> dict[str, Any]:
    return {"id": p.id, "text": p.text, "kcs": p.kcs}
