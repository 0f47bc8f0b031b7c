"""Spoken maths to the notation the course's answer checker reads: Whisper writes what it hears
("minus two, minus three", "X equals three halves"), and a checker that sees "2" and "3" in
"minus 2 minus 3" would grade a wrong answer right. Applied to maths courses only: in a
language course, "one" or "a half" are words the learner chose."""

from __future__ import annotations

import re

_UNITS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_DENOMINATORS = {"half": 2, "halves": 2, "third": 3, "thirds": 3, "quarter": 4, "quarters": 4,
                 "fourth": 4, "fourths": 4, "fifth": 5, "fifths": 5}  # fmt: skip
_TENS_UNIT = re.compile(rf"\b({'|'.join(_TENS)})(?:[\s-]({'|'.join(_UNITS[1:10])}))?\b", re.I)
_UNIT = re.compile(rf"\b({'|'.join(_UNITS)})\b", re.I)
_A_HALF = re.compile(r"\b(?:a|one)\s+half\b", re.I)
_FRACTION = re.compile(rf"\b(\d+)\s+({'|'.join(_DENOMINATORS)})\b", re.I)
_OVER = re.compile(r"\b(\d+)\s+(?:over|divided by)\s+(\d+)\b", re.I)
_SIGN = re.compile(r"\b(?:minus|negative)\s+(?=\d)", re.I)
# "-2 and -3", "-2 -3": a list of values, written as the checker reads one ("-2, -3"; after
# "and", a minus would read as subtraction).
_LIST = re.compile(r"(?<!\^\d)(?<=\d)(?:\s*,)?(?:\s+(?:and|or))?\s+(?=[-±]?\d)", re.I)
_WORDS = [
    (re.compile(r"\b(?:is equal to|equal to|equals|equal)\b", re.I), "="),
    (re.compile(r"\bplus or minus\b", re.I), "±"),
    (re.compile(r"\bminus\b", re.I), "-"),
    (re.compile(r"\bplus\b", re.I), "+"),
    (re.compile(r"\b(?:times|multiplied by)\b", re.I), "*"),
    (re.compile(r"\s*\bsquared\b", re.I), "^2"),
    (re.compile(r"\b([A-Z])\b(?=\s*[=+*^-])"), lambda m: m[1].lower()),  # "X =" is x
]


def spoken_math(text: str) -> str:
    """ "X equals minus three halves or X equals two" → "x = -3/2 or x = 2";
    "minus two and minus three" → "-2, -3"."""
    text = _TENS_UNIT.sub(
        lambda m: str(10 * (_TENS.index(m[1].lower()) + 2)
                      + (_UNITS.index(m[2].lower()) if m[2] else 0)),
        text,
    )  # fmt: skip
    text = _A_HALF.sub("1/2", text)
    text = _UNIT.sub(lambda m: str(_UNITS.index(m[1].lower())), text)
    text = _FRACTION.sub(lambda m: f"{m[1]}/{_DENOMINATORS[m[2].lower()]}", text)
    text = _OVER.sub(r"\1/\2", text)
    text = _SIGN.sub("-", text)
    for pattern, repl in _WORDS:
        text = pattern.sub(repl, text)
    return _LIST.sub(", ", text)
