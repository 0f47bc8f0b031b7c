"""The agents' prompts. Every prompt of a course starts with the same system message (persona plus
the whole course material), then the session's recent turns, and only then the agent's task, so
the engine's prefix cache serves the long shared part once for all students and agents, and the
session's history once per student.
"""

from __future__ import annotations

import re

from tutorserve.tutor.courses import Course, Problem
from tutorserve.tutor.llm_client import Messages

HISTORY_TURNS = 4
ERROR_LABELS = ("careless", "misconception", "misread", "guess", "right-idea", "stuck")
# The diagnose reply's form, a JSON object enforced by constrained decoding: the label can only
# be one of the set, whatever the model.
DIAGNOSIS_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": list(ERROR_LABELS)},
        "reason": {"type": "string", "maxLength": 160},
    },
    "required": ["label", "reason"],
    "additionalProperties": False,
}

# Written as the student's own request: small models answer a request in the first person
# far more often than they follow third-person instructions (which they tend to repeat back).
LEVEL_TASKS = {
    0: "Is that right? Tell me in one or two short sentences, and why the method works.",
    1: "That is not right yet. Give me one short hint, without telling me the answer.",
    2: "Still not right. Ask me one short guiding question, without telling me the answer.",
    3: "I am stuck. Show me the working step by step, with the answer.",
}
STRICT = "Do not say the answer or any number of it."
# A reply that talks about the student instead of to them, or repeats our instructions back, is
# a model that did not understand the task; the authored text serves better.
_META = re.compile(
    r"\b(the (student|learner|teacher|tutor)|my (answer|mistake)|use this idea)\b", re.I
)
_ECHO_WORDS = 5
# Our instructions are short, so five shared words already mean an echo; earlier replies of the
# session are longer and may share common phrases, so copying one takes eight.
_COPY_WORDS = 8


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    w = re.findall(r"[a-z']+", text.lower())
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


_INSTRUCTION_NGRAMS = set().union(
    *(_ngrams(t, _ECHO_WORDS) for t in [*LEVEL_TASKS.values(), STRICT])
)


def unfit_reply(reply: str, earlier: list[str] = ()) -> str | None:
    """Why a tutor reply should not reach the student, or None if it may. `earlier`: the
    session's previous replies, which a small model likes to copy whatever the problem."""
    if _META.search(reply):
        return "it talks about the student or the task instead of to the student"
    if _ngrams(reply, _ECHO_WORDS) & _INSTRUCTION_NGRAMS:
        return "it repeats the instructions"
    said = _ngrams(reply, _COPY_WORDS)
    if any(said & _ngrams(e, _COPY_WORDS) for e in earlier):
        return "it copies an earlier reply"
    return None


LEVEL_NAMES = {0: "confirmation", 1: "hint", 2: "guiding question", 3: "correction"}


def system_prompt(course: Course) -> str:
    material = "\n\n".join(f"## {kc.name}\n{kc.explanation}" for kc in course.kcs)
    return f"{course.persona.strip()}\n\n# Course material: {course.title}\n\n{material}"


def _history(turns: list[tuple[str, str]]) -> Messages:
    out: Messages = []
    for message, reply in turns[-HISTORY_TURNS:]:
        out += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]
    return out


def diagnose_messages(
    course: Course, problem: Problem, message: str, history: list[tuple[str, str]]
) -> Messages:
    task = (
        f"Problem: {problem.text}\nCorrect answer: {problem.answer}\n"
        f"Student's answer: {message}\n\n"
        f"Classify the student's mistake with one label from: {', '.join(ERROR_LABELS)}. "
        'Reply in JSON: {"label": ..., "reason": one short sentence naming the error}.'
    )
    return _wrap(course, history, task)


def explain_messages(
    course: Course,
    problem: Problem,
    message: str,
    history: list[tuple[str, str]],
    level: int,
    diagnosis: str,
    material: list[str],
    strict: bool = False,
    pedagogical: bool = False,
) -> Messages:
    """`pedagogical`: the cacheable form, which any learner on this problem, rung and diagnosis
    may be served: no history and none of the learner's words (a right answer is shown as the
    problem's own; a wrong one is described only by `diagnosis`, which must then be authored
    text or a label, never the model's reading of the learner's words)."""
    idea = problem.hints[level - 1] if level in (1, 2) else problem.correction if level else ""
    if pedagogical:
        message, history = (problem.answer if level == 0 else ""), []
    parts = [
        "Notes:\n" + "\n".join(material) if material else "",
        f"Problem: {problem.text}",
        f"My answer: {message}" if message else "",
        f"(My mistake: {diagnosis})" if diagnosis and level else "",
        f"{LEVEL_TASKS[level]} Use this idea: {idea}" if idea else LEVEL_TASKS[level],
        STRICT if strict else "",
    ]
    return _wrap(course, history, "\n".join(p for p in parts if p))


def engage_messages(course: Course, history: list[tuple[str, str]], progress: str) -> Messages:
    task = (
        f"Progress so far: {progress}\n\nWrite ONE short, specific sentence of encouragement "
        "for the student about what they are getting better at. No questions."
    )
    return _wrap(course, history, task)


def _wrap(course: Course, history: list[tuple[str, str]], task: str) -> Messages:
    return [
        {"role": "system", "content": system_prompt(course)},
        *_history(history),
        {"role": "user", "content": task},
    ]
