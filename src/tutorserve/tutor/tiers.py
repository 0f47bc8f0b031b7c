"""Model tiers and the policy that picks one per agent call from the learner's state.

A tier is what writes an agent's text: the course's authored text, a small model, or a large
one. The policy is an object chosen once when the service is built; agents ask it, never compare
policy names themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol


class Tier(IntEnum):
    """Ordered by cost: `down()` is the next cheaper tier, which degradation falls back to."""

    AUTHORED = 0
    SMALL = 1
    LARGE = 2

    @classmethod
    def _missing_(cls, value: object) -> Tier | None:
        """A tier by its label too ("small"), as config files name it."""
        return next((t for t in cls if t.label == value), None)

    def down(self) -> Tier:
        return Tier(max(0, self - 1))

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Situation:
    """What the policy may look at: which agent, the ladder rung, the learner's lowest mastery
    over the problem's KCs, their wrong answers in a row (this one included), and the highest
    CEFR level of the problem's KCs ("" for a course without one)."""

    agent: str
    rung: int
    mastery: float
    recent_errors: int
    cefr: str = ""


class TieringPolicy(Protocol):
    name: str

    def tier(self, s: Situation) -> Tier: ...


@dataclass(frozen=True, slots=True)
class Uniform:
    """Every model call on one tier: the tutor as it was before tiering (one model for all)."""

    at: Tier = Tier.LARGE
    name: str = "uniform"

    def tier(self, s: Situation) -> Tier:
        return Tier.AUTHORED if s.agent in ("retrieve", "assess") else self.at


_BEGINNER = ("A1", "A2")


@dataclass(frozen=True, slots=True)
class LearnerState:
    """The default policy, from what `bench tutor` measured on SmolLM2-135M:

    - diagnose → small. The label comes from a fixed set under a JSON schema (constrained
      decoding), so even a 135M model gives a valid one; the rung is decided by code anyway.
    - explain, rung 0 (confirmation) → small. The verdict is code; the text only says why the
      method works, and half of the 135M model's confirmations passed the checks.
    - explain, rungs 1–2 (hint, guiding question) → large. Not giving the answer away is the
      hard task: 88–100 % of the 135M model's hints and questions were rejected by the guard.
      A slip by a learner who already masters the KC (`mastery_slip`) on rung 1 needs only a
      nudge → small; a beginner's language course (A1/A2) always gets the large model, since a
      beginner cannot tell a clumsy sentence from a correct one.
    - explain, rung 3 (correction) → authored once the learner has failed `stuck_after` times
      in a row: the course's worked correction is checked by its author, a model's may contain
      slips (one benchmark confirmation mis-factored a quadratic). Before that → large.
    - engage → small after a right answer (a personal sentence where there is progress to
      name), authored otherwise (the template names the weakest KC's mastery; a model sentence
      after every wrong answer is a call per turn for little).
    """

    mastery_slip: float = 0.6
    stuck_after: int = 4
    name: str = "learner-state"

    def tier(self, s: Situation) -> Tier:
        if s.agent in ("retrieve", "assess"):
            return Tier.AUTHORED
        if s.agent == "diagnose":
            return Tier.SMALL
        if s.agent == "engage":
            return Tier.SMALL if s.rung == 0 else Tier.AUTHORED
        if s.rung == 0:
            return Tier.SMALL
        if s.rung == 3:
            return Tier.AUTHORED if s.recent_errors >= self.stuck_after else Tier.LARGE
        if s.rung == 1 and s.mastery >= self.mastery_slip and s.cefr not in _BEGINNER:
            return Tier.SMALL
        return Tier.LARGE


POLICIES: dict[str, type[Uniform] | type[LearnerState]] = {
    "uniform": Uniform,
    "learner-state": LearnerState,
}
