"""What a learner's KC states mean for a course: mastery per KC with error counts, and, for a
language course whose KCs carry CEFR levels, an estimate of the level reached; and which
problem comes next."""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

from tutorserve.tutor.courses import CEFR_LEVELS, Course, Problem
from tutorserve.tutor.store import KCState

MASTERED = 0.95
# A CEFR level counts as reached when the mean mastery of its KCs, and of every lower level's,
# is at least this; a level is a band of skills, so one weak KC should not cancel it.
CEFR_REACHED = 0.7


def cefr_estimate(course: Course, states: dict[str, KCState]) -> dict[str, Any]:
    by_level: dict[str, list[float]] = {}
    for kc in course.kcs:
        if kc.cefr:
            by_level.setdefault(kc.cefr, []).append(states[kc.id].p_mastery)
    means = {lvl: round(sum(v) / len(v), 4) for lvl in CEFR_LEVELS if (v := by_level.get(lvl))}
    reached = None
    for lvl, mean in means.items():
        if mean < CEFR_REACHED:
            break
        reached = lvl
    label = reached or f"below {next(iter(means))}"
    return {"level": reached, "label": label, "by_level": means, "threshold": CEFR_REACHED}


def course_progress(course: Course, states: dict[str, KCState]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "mastery": [
            {
                "kc": kc.id,
                "name": kc.name,
                "p_mastery": round(states[kc.id].p_mastery, 4),
                "attempts": states[kc.id].attempts,
                "errors": states[kc.id].errors,
                "mastered": states[kc.id].p_mastery >= MASTERED,
                "cefr": kc.cefr,
            }
            for kc in course.kcs
        ]
    }
    if course.has_cefr:
        out["cefr"] = cefr_estimate(course, states)
    return out


def kc_states(course: Course, stored: dict[str, KCState]) -> dict[str, KCState]:
    """Every KC's state, starting unseen ones at their prior."""
    return {k.id: stored.get(k.id) or KCState(p_mastery=k.bkt.prior) for k in course.kcs}


def pick_problem(course: Course, states: Mapping[str, KCState], solved: Set[str]) -> Problem | None:
    """The first unsolved problem, in authored order, that still exercises an unmastered KC;
    else the first unsolved one; None once everything is solved."""
    unsolved = [p for p in course.problems if p.id not in solved]
    for p in unsolved:
        if any(states[k].p_mastery < MASTERED for k in p.kcs):
            return p
    return unsolved[0] if unsolved else None
