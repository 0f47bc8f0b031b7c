"""explain: the reply for this rung of the Socratic ladder, streamed to the student through the
answer-leak guard. The verdict ("Correct!", "Not quite.") comes from code first, so even a
confused model cannot get it wrong; a reply that leaks the answer twice, or is unfit, is replaced
by the course's authored text for the rung. With the reply cache on, the prompt is the
pedagogical one (no learner words, no history), and its outcome — the checked reply, or "the
authored text serves" — is cached for every learner on the same problem, rung and diagnosis."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from langgraph.runtime import Runtime

from tutorserve.tutor import prompts
from tutorserve.tutor.agents.agent import Agent, Update, reply_key
from tutorserve.tutor.costs import answered_by, begin_call, logged_calls
from tutorserve.tutor.ladder import MAX_LEVEL, AnswerLeak, RejectedReply, guarded
from tutorserve.tutor.reply_cache import CachedReply, ReplyKey
from tutorserve.tutor.routing import AllTiersDown
from tutorserve.tutor.tiers import Tier
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


def _pedagogy(turn: Turn, d: Diagnosis) -> tuple[str, str]:
    """(cache label, what the prompt says of the mistake) without the learner's words: an
    authored misconception by its index and text, a model diagnosis by its label only."""
    if d["source"] == "authored":
        found = [i for i, m in enumerate(turn.problem.misconceptions) if m.diagnosis == d["reason"]]
        return f"misconception/{found[0] if found else '?'}", d["reason"]
    return d["label"], d["label"] if d["source"] == "model" else ""


def _unfit(reply: str, level: int) -> str | None:
    """Why a reply is unfit whoever asked (the cacheable part of the checks)."""
    why = prompts.unfit_reply(reply)
    if why is None and level == 2 and "?" not in reply:
        why = "it asks no question on the guiding-question rung"
    return why


def _whole_sentences(text: str) -> str:
    """`text` without a sentence the token limit cut off (the page shows the final reply)."""
    text = text.strip()
    if text.endswith((".", "!", "?")):
        return text
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", text)]
    return text[: ends[-1]] if ends else text


class _Shown:
    """The reply as the student has seen it so far (streamed as deltas); a reset starts it again
    from the verdict."""

    def __init__(self, write: Callable[[dict], None], said: str) -> None:
        self.write, self.said, self.parts = write, said, [said]
        write({"event": "delta", "text": said})

    def emit(self, text: str) -> None:
        self.parts.append(text)
        self.write({"event": "delta", "text": text})

    def restart(self) -> None:
        self.parts.clear()
        self.write({"event": "reset"})
        self.emit(self.said)

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def run(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
    turn, d, routing = state["turn"], state["diagnosis"], runtime.context.routing
    shown = _Shown(runtime.stream_writer, verdict(d))
    wrong = d["kind"] == "answer" and not d["correct"]
    tier = routing.tier(turn.situation(AGENT.name, d["level"], wrong), turn.cap)
    if tier is Tier.AUTHORED:  # the policy's choice, not a failure
        shown.emit(authored(turn, d))
        return {"reply": shown.text}
    cache = routing.cache
    if cache is None:
        material = state.get("material", [])
        return await _write(turn, d, tier, None, d.get("reason", ""), material, shown, runtime)
    label, mistake = _pedagogy(turn, d)
    # What was retrieved may follow the learner's words; the cacheable prompt keeps to the
    # problem's own KCs.
    material = [f"{turn.course.kc[k].name}: {turn.course.kc[k].explanation}"
                for k in turn.problem.kcs]  # fmt: skip
    key = reply_key(AGENT.name, turn, d["level"], label, routing.model_name(tier))
    if (hit := await cache.lookup(key)) is not None:
        begin_call(tier, key.model, cached_reply=True, saved_tokens=hit.tokens)
        if hit.text and prompts.unfit_reply(hit.text, [r for _, r in turn.history]) is None:
            shown.emit(hit.text)
            return {"reply": shown.text}
        shown.emit(authored(turn, d))
        return {"reply": shown.text, "fallbacks": [AGENT.name]}
    try:
        return await _write(turn, d, tier, key, mistake, material, shown, runtime)
    finally:
        cache.written(key)  # the class waiting for this reply looks again


async def _write(
    turn: Turn, d: Diagnosis, tier: Tier, key: ReplyKey | None, mistake: str,
    material: list[str], shown: _Shown, runtime: Runtime[TutorContext],
) -> Update:  # fmt: skip
    """The model's reply through the guard and the checks, else the authored text; with `key`,
    the outcome goes into the reply cache."""
    level, routing = d["level"], runtime.context.routing
    earlier = [r for _, r in turn.history]

    async def generate() -> str:
        for strict in (False, True):
            messages = prompts.explain_messages(
                turn.course, turn.problem, turn.message, turn.history, level,
                mistake, material, strict, pedagogical=key is not None,
            )  # fmt: skip
            deltas = routing.stream(
                tier, messages, max_tokens=96, temperature=0.3, session_id=turn.session_id,
                scope=f"explain/{turn.course.id}/{turn.problem.id}/{level}",
                priority=turn.priority,
            )  # fmt: skip
            # The answer is the point of a confirmation or a correction: no guard there.
            watched = None if level in (0, MAX_LEVEL) else turn.problem
            try:
                return await guarded(deltas, watched, shown.emit)
            except AnswerLeak:
                log.info("tutor reply leaked the answer (strict=%s); regenerating", strict)
                shown.restart()
        raise AnswerLeak("the model gave the answer away twice")

    def remember(text: str) -> None:
        if key is not None and routing.cache is not None and (calls := logged_calls()):
            tokens = sum(c.tokens for c in calls)
            routing.cache.fill(key, answered_by(calls), CachedReply(text, tokens))

    try:
        deadline = runtime.context.timeouts[AGENT.name]
        reply = _whole_sentences(await asyncio.wait_for(generate(), deadline))
        if not reply:
            raise ValueError("the model returned an empty reply")
        if why := _unfit(reply, level):
            remember("")
            raise RejectedReply(why)
        remember(reply)
        if why := prompts.unfit_reply(reply, earlier):  # this learner's history only
            raise RejectedReply(why)
        return {"reply": shown.said + reply}
    except AnswerLeak as e:  # leaked twice: so it would for anyone
        log.info("tutor reply rejected (%s); using the authored text", e)
        remember("")
    except RejectedReply as e:  # unfit: the authored text for this rung
        log.info("tutor reply rejected (%s); using the authored text", e)
    except (TimeoutError, ValueError, AllTiersDown) as e:
        log.warning("tutor explain fell back (%s: %s)", type(e).__name__, e)
        if shown.text != shown.said:  # keep what the student already saw rather than replace it
            return {"reply": shown.text, "fallbacks": [AGENT.name]}
    shown.restart()
    shown.emit(authored(turn, d))
    return {"reply": shown.text, "fallbacks": [AGENT.name]}


def fallback(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
    reply = verdict(state["diagnosis"]) + authored(state["turn"], state["diagnosis"])
    runtime.stream_writer({"event": "reset"})
    runtime.stream_writer({"event": "delta", "text": reply})
    return {"reply": reply}


AGENT = Agent("explain", timeout=60.0, run=run, fallback=fallback, grace=1.0)
