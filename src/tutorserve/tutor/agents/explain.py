"""explain: the reply for this rung of the Socratic ladder, streamed to the student through the
answer-leak guard. The verdict ("Correct!", "Not quite.") comes from code first, so even a
confused model cannot get it wrong; a reply that leaks the answer twice, or is unfit, is replaced
by the course's authored text for the rung."""

from __future__ import annotations

import asyncio
import logging
import re

from langgraph.runtime import Runtime

from tutorserve.tutor import prompts
from tutorserve.tutor.agents.agent import Agent, Update
from tutorserve.tutor.ladder import MAX_LEVEL, AnswerLeak, RejectedReply, guarded
from tutorserve.tutor.turn import Diagnosis, Turn, TurnState, TutorContext

log = logging.getLogger(__name__)


def verdict(d: Diagnosis) -> str:
    """How the reply opens: a right or wrong answer, or nothing for a question."""
    if d["kind"] != "answer":
        return ""
    return "Correct! " if d["correct"] else "Not quite. "


def authored(turn: Turn, d: Diagnosis) -> str:
    """The course's own text for this rung."""
    p, level = turn.problem, d["level"]
    if level == 0:
        return f"The answer is {p.answer}."
    if level == MAX_LEVEL:
        return p.correction
    return p.hints[level - 1]


def _whole_sentences(text: str) -> str:
    """`text` without a sentence the token limit cut off (the page shows the final reply)."""
    text = text.strip()
    if text.endswith((".", "!", "?")):
        return text
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", text)]
    return text[: ends[-1]] if ends else text


async def run(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
    turn, d, services = state["turn"], state["diagnosis"], runtime.context
    level, said = d["level"], verdict(d)
    write = runtime.stream_writer
    shown: list[str] = []

    def emit(text: str) -> None:
        shown.append(text)
        write({"event": "delta", "text": text})

    def restart() -> None:
        shown.clear()
        write({"event": "reset"})
        emit(said)

    async def generate() -> str:
        for strict in (False, True):
            messages = prompts.explain_messages(
                turn.course, turn.problem, turn.message, turn.history, level,
                d.get("reason", ""), state.get("material", []), strict,
            )  # fmt: skip
            deltas = services.llm.stream(
                messages, max_tokens=96, temperature=0.3, session_id=turn.session_id,
                scope=f"explain/{turn.course.id}/{turn.problem.id}/{level}",
            )  # fmt: skip
            # The answer is the point of a confirmation or a correction: no guard there.
            watched = None if level in (0, MAX_LEVEL) else turn.problem
            try:
                return await guarded(deltas, watched, emit)
            except AnswerLeak:
                log.info("tutor reply leaked the answer (strict=%s); regenerating", strict)
                restart()
        raise AnswerLeak("the model gave the answer away twice")

    emit(said)
    try:
        deadline = services.timeouts[AGENT.name]
        reply = _whole_sentences(await asyncio.wait_for(generate(), deadline))
        if not reply:
            raise ValueError("the model returned an empty reply")
        why = prompts.unfit_reply(reply, [r for _, r in turn.history])
        if why is None and level == 2 and "?" not in reply:
            why = "it asks no question on the guiding-question rung"
        if why:
            raise RejectedReply(why)
        return {"reply": said + reply}
    except RejectedReply as e:  # leaked twice, or unfit: the authored text for this rung
        log.info("tutor reply rejected (%s); using the authored text", e)
    except (TimeoutError, ValueError) as e:
        log.warning("tutor explain fell back (%s: %s)", type(e).__name__, e)
        if "".join(shown) != said:  # keep what the student already saw rather than replace it
            return {"reply": "".join(shown), "fallbacks": [AGENT.name]}
    restart()
    emit(authored(turn, d))
    return {"reply": "".join(shown), "fallbacks": [AGENT.name]}


def fallback(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
    reply = verdict(state["diagnosis"]) + authored(state["turn"], state["diagnosis"])
    runtime.stream_writer({"event": "reset"})
    runtime.stream_writer({"event": "delta", "text": reply})
    return {"reply": reply}


AGENT = Agent("explain", timeout=60.0, run=run, fallback=fallback, grace=1.0)
