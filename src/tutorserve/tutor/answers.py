"""Checking a student's answer, and telling whether a tutor reply gives the answer away.

Numeric answers are sets of values ("2, -3" for the roots of a quadratic), compared order-free
with a tolerance, so "x = -3 or x = 2", "x = 2, -3" and "(x-2)(x+3) = 0 so 2 and -3" all count.
Text answers (a word for a gap) match as whole words, case- and punctuation-insensitively.

The leak test is deliberately strict: a reply that mentions an answer value on its own counts as
a leak, since a regenerated or authored hint costs little and a leaked answer ends the exercise.
It must not fire on what the problem itself says, so a value that also appears in the problem's
text leaks only when stated as a result ("= 3", "is 3", quoted).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol


class _WrongAnswer(Protocol):
    answer: str


class Problem(Protocol):
    """What these checks read of a problem (`courses.Problem` is one; the courses module
    imports this one to vet its hints, so it is described here rather than imported)."""

    text: str
    answer_type: str
    misconceptions: Sequence[_WrongAnswer]

    @property
    def answer_forms(self) -> list[str]: ...


# A number not glued to a letter, digit, decimal point or caret ("x^2" is not a 2), with
# optional thousands separators, decimals and a fraction bar.
_NUM = re.compile(
    r"(?<![\w.^/])(?P<sign>[-±]\s?)?(?P<num>\d{1,3}(?:,\d{3})+|\d+)(?P<dec>\.\d+)?"
    r"(?:\s?/\s?(?P<den>\d+))?(?![\w/]|\.\d)"
)
_VULGAR = str.maketrans({"½": "1/2", "⅓": "1/3", "⅔": "2/3", "¼": "1/4", "¾": "3/4", "−": "-"})
_ASSIGNED = re.compile(r"(?<![\w^])[a-z][0-9]?\s*=\s*$")  # "x =": an unknown's value
_OPERATOR_BEFORE = re.compile(r"([-+*/^=<>]|[\w)]\s*-)\s*$")
_OPERATOR_AFTER = re.compile(r"^\s*[-+*/^=<>)]")
_NUMBER_WORDS = {
    w: i
    for i, w in enumerate(
        ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    )
}
_NO_SOLUTION = re.compile(r"\b(none|no (real )?(solutions?|roots?))\b", re.I)
_STATED = re.compile(r"(=|\bis|\bare|\bequals|answer\b[^.?!]{0,20}|:)\s*[\"'*“‘]*\s*$", re.I)
_NAMED = re.compile(
    r"((answer|word|article|form|verb)\s+(is|would be|should be)|[:=])\s*[\"'*“‘]*\s*$", re.I
)
_WORD = re.compile(r"[a-z0-9']+")
_TOL = 1e-6


def _value(m: re.Match[str]) -> float:
    v = float(m["num"].replace(",", "") + (m["dec"] or ""))
    if m["den"]:
        den = float(m["den"])
        v = v / den if den else float("nan")
    return v


def numbers(text: str) -> list[tuple[float, re.Match[str]]]:
    """Signed values in `text` ("±3" gives 3 and -3), each with its match."""
    text = text.translate(_VULGAR)
    out = []
    for m in _NUM.finditer(text):
        v = _value(m)
        sign = (m["sign"] or "").strip()
        if sign == "±":
            out += [(v, m), (-v, m)]
        else:
            out.append((-v if sign == "-" else v, m))
    return out


def answer_values(answer: str) -> set[float]:
    vals = {round(v, 6) for v, _ in numbers(answer)}
    if not vals:
        raise ValueError(f"numeric answer {answer!r} has no number in it")
    return vals


def offered_values(message: str) -> list[tuple[float, float]]:
    """The values a student's message offers as the answer, each with its tolerance.

    Numbers inside an expression or equation ("x^2 - 5x + 6 = 0", "(x-2)(x-3)", "D = -16")
    are working, not answers; "x = 2", a bare "2", and "2" in "x = 3 or 2" are answers. A value
    given to two or more decimals matches to that precision (0.33 for 1/3).
    """
    text = message.translate(_VULGAR)
    out = []
    for v, m in numbers(text):
        before, after = text[: m.start()], text[m.end() :]
        assigned = _ASSIGNED.search(before)
        signed = (m["sign"] or "").strip() == "-"
        if not assigned and (_OPERATOR_BEFORE.search(before) or _OPERATOR_AFTER.search(after)):
            continue
        if signed and re.search(r"[\w)]\s*$", before):  # "x - 3" is a subtraction, not -3
            continue
        places = len(m["dec"]) - 1 if m["dec"] else 0
        out.append((v, 0.5 * 10.0**-places if places >= 2 else _TOL))
    if not out and len(message.split()) <= 4:  # "two", "no real solutions"
        words = _words(message)
        out = [(float(_NUMBER_WORDS[w]), _TOL) for w in words if w in _NUMBER_WORDS]
        out += [(0.0, _TOL)] if _NO_SOLUTION.search(message) else []
    return out


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace("’", "'"))


def _contains_phrase(words: list[str], phrase: list[str]) -> bool:
    n = len(phrase)
    return n > 0 and any(words[i : i + n] == phrase for i in range(len(words) - n + 1))


def is_correct(message: str, problem: Problem) -> bool:
    """Whether the student's message answers `problem` right. A text answer that also names a
    known wrong one ("a/an") is not right."""
    if not matches(message, problem.answer_forms, problem.answer_type):
        return False
    wrong = [m.answer for m in problem.misconceptions]
    return problem.answer_type != "text" or not matches(message, wrong, "text")


def matches(message: str, forms: list[str], answer_type: str) -> bool:
    """Whether `message` gives one of the answers `forms` (also used for known wrong ones)."""
    if answer_type == "text":
        words = _words(message)
        return any(_contains_phrase(words, _words(form)) for form in forms)
    given = offered_values(message)
    for want in map(answer_values, forms):
        if (
            given
            and all(any(abs(g - w) <= tol for w in want) for g, tol in given)
            and all(any(abs(g - w) <= tol for g, tol in given) for w in want)
        ):
            return True
    return False


def _stated(reply: str, start: int) -> bool:
    return bool(_STATED.search(reply[max(0, start - 30) : start]))


def _quoted(reply: str, form: str) -> bool:
    q = re.escape(form)
    return bool(re.search(rf"[\"'*“‘]{q}[\"'*”’]", reply, re.IGNORECASE))


def leaks_answer(reply: str, problem: Problem) -> bool:
    """Whether `reply` gives away `problem`'s answer (see the module doc for the rule)."""
    if problem.answer_type == "text":
        return any(_leaks_text(reply, problem.text, form) for form in problem.answer_forms)
    in_problem = {round(abs(v), 6) for v, _ in numbers(problem.text)}
    targets = {abs(v) for form in problem.answer_forms for v in answer_values(form)}
    for v, m in numbers(reply):
        if not any(abs(abs(v) - t) < _TOL for t in targets):
            continue
        if round(abs(v), 6) not in in_problem or _stated(reply, m.start()):
            return True
    return False


def _leaks_text(reply: str, problem_text: str, form: str) -> bool:
    words, phrase = _words(reply), _words(form)
    if not _contains_phrase(words, phrase):
        return False
    if _quoted(reply, form) or any(
        _NAMED.search(reply[max(0, m.start() - 30) : m.start()])
        for m in re.finditer(rf"\b{re.escape(form)}\b", reply, re.I)
    ):
        return True
    # The gap filled in ("___ moon" -> "the moon") gives it away, whatever the word's length.
    before, _, after = problem_text.partition("___")
    context = [*_words(before)[-1:], *phrase], [*phrase, *_words(after)[:1]]
    if any(len(c) > len(phrase) and _contains_phrase(words, c) for c in context):
        return True
    # A short word ("a", "the", "was") is everywhere; a longer one on its own is the answer,
    # unless the problem itself says it.
    return len(form) >= 4 and not _contains_phrase(_words(problem_text), phrase)
