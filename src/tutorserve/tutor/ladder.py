"""The Socratic ladder and its answer-leak guard.

Repeated errors on a problem's KCs climb the ladder: level 1 hint, level 2 guiding question,
level 3 explicit correction (level 0 confirms a right answer). Below level 3 the reply must not
give the answer away; the guard watches the stream as it is generated and holds back the
unfinished tail, so a leaking reply is caught before any part of the answer reaches the student.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable

from tutorserve.tutor.answers import leaks_answer, matches, offered_values
from tutorserve.tutor.courses import Problem

MAX_LEVEL = 3
_HELP = re.compile(r"\b(hint|help|don'?t know|do not know|no idea|not sure|stuck|explain)\b", re.I)
# Text held back behind the last complete word: enough to see a quote close or the word after
# a gap ("the" + "moon") before releasing the word in front of it.
_HOLD = 24


def message_kind(message: str, problem: Problem) -> str:
    """ "answer" for an attempt at the problem ("2 or 3?" included), "help" for a question or a
    plea for help."""
    if _HELP.search(message):
        return "help"
    if problem.answer_type == "numeric":
        return "answer" if offered_values(message) else "help"
    words = message.split()
    if len(words) > 12:
        return "help"
    # "What does 'ago' mean?" is a question; "went?" or "Is it went?" is a hesitant answer.
    known = [*problem.answer_forms, *(m.answer for m in problem.misconceptions)]
    question = message.rstrip().endswith("?") and len(words) > 3
    return "help" if question and not matches(message, known, "text") else "answer"


def ladder_level(correct: bool, kind: str, consecutive_errors: int) -> int:
    """The rung for this turn; `consecutive_errors` counts wrong answers before this one."""
    if kind == "answer" and correct:
        return 0
    wrong_now = 1 if kind == "answer" else 0
    return max(1, min(MAX_LEVEL, consecutive_errors + wrong_now))


# Below the correction rung the tutor states no answer at all: a right one is a leak, and a
# wrong one ("the correct answer is x = 6", as small models like to say) misleads.
_STATES_ANSWER = re.compile(
    r"\b[xyz]\s*=\s*[-−]?\d|\b(correct|right|final) answer\b|\banswer (is|was|would be)\b", re.I
)


class RejectedReply(Exception):
    """A generated reply that must not reach the student; the authored text replaces it."""


class AnswerLeak(RejectedReply):
    """The reply being generated gives the answer away, or states one."""


def _leaks(text: str, problem: Problem) -> bool:
    return bool(_STATES_ANSWER.search(text)) or leaks_answer(text, problem)


class LeakGuard:
    """Feeds generated text through; yields only text that cannot be part of a leak."""

    def __init__(self, problem: Problem | None) -> None:
        self.problem = problem
        self.text = ""
        self.released = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        # Words still being generated ("3" may become "30") are not judged yet.
        cut = max(self.text.rfind(" "), self.text.rfind("\n"))
        stable = self.text[: cut + 1] if cut >= 0 else ""
        if self.problem is None:
            return self._release(len(self.text))
        if stable and _leaks(stable, self.problem):
            raise AnswerLeak(stable)
        return self._release(len(stable) - _HOLD)

    def finish(self) -> str:
        if self.problem is not None and _leaks(self.text, self.problem):
            raise AnswerLeak(self.text)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        out = self.text[self.released : upto]
        self.released = upto
        return out


async def guarded(
    deltas: AsyncIterator[str], problem: Problem | None, emit: Callable[[str], None]
) -> str:
    """Stream `deltas` to `emit` through a LeakGuard (none for `problem` None); the whole
    reply, or AnswerLeak (the generation is then abandoned, which aborts it)."""
    guard = LeakGuard(problem)
    try:
        async for delta in deltas:
            if out := guard.feed(delta):
                emit(out)
        if out := guard.finish():
            emit(out)
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
    return guard.text
