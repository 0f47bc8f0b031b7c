"""diagnose: right or wrong and the ladder rung, by code; an authored diagnosis for a known
mistake; for any other wrong answer, the model's label for the mistake."""

from __future__ import annotations

import re

from langgraph.runtime import Runtime

from tutorserve.tutor import prompts
from tutorserve.tutor.agents.agent import Agent, Update
from tutorserve.tutor.answers import is_correct, matches
from tutorserve.tutor.ladder import ladder_level, message_kind
from tutorserve.tutor.llm_client import complete
from tutorserve.tutor.turn import Diagnosis, Turn, TurnState, TutorContext

_LABEL = re.compile(r"\b(" + "|".join(map(re.escape, prompts.ERROR_LABELS)) + r")\b", re.I)


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


async def run(state: TurnState, runtime: Runtime[TutorContext]) -> Update:
    turn = state["turn"]
    d = judge(turn)
    if d["kind"] == "answer" and not d["correct"] and d["source"] != "authored":
        text = await complete(
            runtime.context.llm,
            prompts.diagnose_messages(turn.course, turn.problem, turn.message, turn.history),
            max_tokens=40,
            session_id=turn.session_id,
            scope=f"diagnose/{turn.course.id}/{turn.problem.id}",
            regex=prompts.DIAGNOSIS_FORMAT,
        )
        # Only a reply in the asked form is used: free text from a confused model would
        # otherwise flow into the explanation prompt.
        if label := _LABEL.match(text.strip()):
            reason = text.strip()[label.end() :].lstrip(" :-").split("\n")[0]
            d |= {"label": label[1].lower(), "reason": reason, "source": "model"}
    return {"diagnosis": d}


AGENT = Agent(
    "diagnose", timeout=20.0, run=run, fallback=lambda state, _: {"diagnosis": judge(state["turn"])}
)
