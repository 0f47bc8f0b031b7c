"""diagnose: right or wrong and the ladder rung, by code; an authored diagnosis for a known
mistake; for any other wrong answer, the model's label for the mistake, a JSON object (label
from the fixed set, short reason) under constrained decoding."""

from __future__ import annotations

import json
import re

from langgraph.runtime import Runtime

from tutorserve.tutor import prompts
from tutorserve.tutor.agents.agent import Agent, Update, reply_key
from tutorserve.tutor.answers import is_correct, matches
from tutorserve.tutor.costs import answered_by, begin_call, logged_calls
from tutorserve.tutor.ladder import ladder_level, message_kind
from tutorserve.tutor.reply_cache import CachedReply, normalized
from tutorserve.tutor.tiers import Tier
from tutorserve.tutor.turn import Diagnosis, Turn, TurnState, TutorContext

# A reply cut off by the token limit still starts with its label (the schema puts it first).
_LABEL_FIRST = re.compile(r'^\s*\{\s*"label"\s*:\s*"([a-z-]+)"')


def judge(turn: Turn) -> Diagnosis:
    p = turn.problem
    kind = message_kind(turn.message, p)
    correct = kind == "answer" and is_correct(turn.message, p)
    streak = max(turn.states[k].consecutive_errors for k in p.kcs)
    d: Diagnosis = {
        "kind": kind,
        "correct": correct,
        "level": ladder_level(correct, kind, streak),
        "label": "correct" if correct else ("help-request" if kind == "help" else "unclassified"),
        "reason": "",
        "source": "code",
    }
    if kind == "answer" and not correct:
        for m in p.misconceptions:
            if matches(turn.message, [m.answer], p.answer_type):
                d |= {"label": "misconception", "reason": m.diagnosis, "source": "authored"}
                break
    return d


def parse(text: str) -> tuple[str, str] | None:
    """(label, reason) from the model's JSON, or None if it has no label of the set."""
    try:
        obj = json.loads(text)
        label, reason = obj.get("label"), obj.get("reason", "")
    except (ValueError, AttributeError):
        found = _LABEL_FIRST.match(text)
        label, reason = (found[1], "") if found else (None, "")
    if label not in prompts.ERROR_LABELS or not isinstance(reason, str):
        return None
    return label, reason.strip().split("\n")[0]


async def run(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
    turn, routing = state["turn"], runtime.context.routing
    d = judge(turn)
    if d["kind"] != "answer" or d["correct"] or d["source"] == "authored":
        return {"diagnosis": d}
    tier = routing.tier(turn.situation(AGENT.name, d["level"], wrong=True), turn.cap)
    if tier is Tier.AUTHORED:
        return {"diagnosis": d}
    # The diagnosis reads the learner's answer, so its cache key carries that answer: only a
    # learner who gave the same answer to the same problem shares it.
    cache, key, text = routing.cache, None, None
    if cache is not None:
        key = reply_key(AGENT.name, turn, d["level"], "", routing.model_name(tier),
                        said=normalized(turn.message))  # fmt: skip
        if (hit := await cache.lookup(key)) is not None:
            begin_call(tier, key.model, cached_reply=True, saved_tokens=hit.tokens)
            text = hit.text
    if text is None:
        try:
            text = await routing.complete(
                tier,
                prompts.diagnose_messages(turn.course, turn.problem, turn.message,
                                          [] if cache is not None else turn.history),
                max_tokens=64,
                temperature=0.0,
                session_id=turn.session_id,
                scope=f"diagnose/{turn.course.id}/{turn.problem.id}",
                schema=prompts.DIAGNOSIS_SCHEMA,
                priority=turn.priority,
            )  # fmt: skip
            if cache is not None and key is not None and (calls := logged_calls()):
                tokens = sum(c.tokens for c in calls)
                cache.fill(key, answered_by(calls), CachedReply(text, tokens))
        finally:
            if cache is not None and key is not None:
                cache.written(key)
    # Only a reply of the asked form is used: free text from a confused model (or a server
    # that ignored the schema) would otherwise flow into the explanation prompt.
    if found := parse(text):
        d |= {"label": found[0], "reason": found[1], "source": "model"}
    return {"diagnosis": d}


AGENT = Agent(
    "diagnose", timeout=20.0, run=run, fallback=lambda state, _: {"diagnosis": judge(state["turn"])}
)
