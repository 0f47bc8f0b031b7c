"""Education-shaped workloads: many students of a course share a long course prompt.

Text is generated deterministically from a seed (no data download), rendered through the model's
chat template, and measured in the model's own tokens so every system sees identical token ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tutorserve.models.tokenizer import Tokenizer

_SUBJECTS = [
    "algebra",
    "geometry",
    "chemistry",
    "biology",
    "English grammar",
    "history",
    "physics",
    "statistics",
    "programming",
    "geography",
]
_WORDS = [
    "student",
    "tutor",
    "explain",
    "equation",
    "variable",
    "factor",
    "solve",
    "example",
    "hint",
    "question",
    "answer",
    "reason",
    "step",
    "check",
    "mistake",
    "concept",
    "practice",
    "graph",
    "number",
    "term",
    "slope",
    "root",
    "energy",
    "cell",
    "atom",
    "verb",
    "tense",
    "article",
    "sentence",
    "evidence",
    "source",
    "cause",
    "effect",
    "model",
    "data",
    "mean",
    "error",
    "proof",
    "rule",
    "idea",
    "carefully",
    "always",
    "never",
    "first",
    "then",
    "next",
    "finally",
    "because",
    "therefore",
    "however",
    "when",
    "while",
]


@dataclass(slots=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    course: int


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 16))]
    return " ".join(words).capitalize() + "."


def _text_of_tokens(tok: Tokenizer, rng: random.Random, n_tokens: int, head: str) -> str:
    parts = [head]
    while len(tok.encode(" ".join(parts), add_special_tokens=False)) < n_tokens:
        parts.append(_sentence(rng))
    return " ".join(parts)


def edu_shared_prefix(
    tok: Tokenizer,
    *,
    courses: int = 8,
    students: int = 8,
    prefix_tokens: int = 1000,
    question_tokens: int = 60,
    output_tokens: int = 64,
    seed: int = 0,
    question_seed: int | None = None,
) -> list[Request]:
    """courses × students requests, interleaved the way an evening of traffic arrives.
    `seed` fixes the course prompts; `question_seed` (default: seed) the students' questions,
    so another cohort of the same courses can be drawn."""
    rng = random.Random(seed)
    systems = [
        _text_of_tokens(
            tok,
            rng,
            prefix_tokens,
            f"You are a Socratic tutor for {_SUBJECTS[c % len(_SUBJECTS)]} "
            f"(course {seed}-{c}). Never give the answer away; ask guiding questions.",
        )
        for c in range(courses)
    ]
    rng = random.Random(seed if question_seed is None else question_seed + 7919)
    out = []
    for s in range(students):
        for c in range(courses):
            question = _text_of_tokens(tok, rng, question_tokens, f"Student {s}: I am stuck.")
            messages = [
                {"role": "system", "content": systems[c]},
                {"role": "user", "content": question},
            ]
            text = (
                tok.apply_chat_template(messages)
                if tok.chat_template
                else (systems[c] + "\n" + question)
            )
            out.append(Request(tok.encode(text), output_tokens, c))
    return out
