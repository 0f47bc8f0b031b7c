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


# ---- serving workloads: sessions of turns, sent as text to any OpenAI-compatible server --------
@dataclass(slots=True)
class Turn:
    question: str
    max_tokens: int
    think_time_s: float = 0.0  # the student's pause before sending this turn


@dataclass(slots=True)
class Session:
    """One student's conversation; single-turn workloads are sessions of one turn."""

    system: str | None
    turns: list[Turn]
    course: int = 0

    def messages(self, answers: list[str], turn: int) -> list[dict[str, str]]:
        """The chat up to `turn`: earlier questions with the server's own answers to them."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t, answer in zip(self.turns[:turn], answers, strict=True):
            msgs += [
                {"role": "user", "content": t.question},
                {"role": "assistant", "content": answer},
            ]
        return [*msgs, {"role": "user", "content": self.turns[turn].question}]


WORKLOADS = ("edu-shared-prefix", "edu-multiturn", "random")


def serving_workload(tok: Tokenizer, name: str, num_requests: int, seed: int = 0) -> list[Session]:
    """Sessions totalling `num_requests` requests, fixed by `seed` (lengths in model tokens)."""
    if num_requests < 1:
        raise ValueError("num_requests must be at least 1")
    rng = random.Random(seed)
    if name == "edu-shared-prefix":
        # Courses are few and long-prompted; students many, questions short, answers short.
        courses = max(1, num_requests // 16)
        systems = [
            _course_prompt(tok, rng, seed, c, rng.randint(1000, 2000)) for c in range(courses)
        ]
        return [
            Session(
                systems[i % courses],
                [Turn(_question(tok, rng, i, rng.randint(30, 90)), rng.randint(32, 96))],
                i % courses,
            )
            for i in range(num_requests)
        ]
    if name == "edu-multiturn":
        turns = 4
        courses = max(1, num_requests // (turns * 8))
        systems = [_course_prompt(tok, rng, seed, c, rng.randint(300, 600)) for c in range(courses)]
        return [
            Session(
                systems[s % courses],
                [
                    Turn(
                        _question(tok, rng, s, rng.randint(20, 60)),
                        rng.randint(32, 96),
                        0.0 if t == 0 else rng.uniform(1.0, 4.0),
                    )
                    for t in range(min(turns, num_requests - s * turns))
                ],
                s % courses,
            )
            for s in range(-(-num_requests // turns))
        ]
    if name == "random":
        return [
            Session(
                None, [Turn(_question(tok, rng, i, rng.randint(64, 1024)), rng.randint(16, 256))]
            )
            for i in range(num_requests)
        ]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _course_prompt(tok: Tokenizer, rng: random.Random, seed: int, c: int, n_tokens: int) -> str:
    head = (
        f"You are a Socratic tutor for {_SUBJECTS[c % len(_SUBJECTS)]} (course {seed}-{c}). "
        "Never give the answer away; ask one guiding question at a time."
    )
    return _text_of_tokens(tok, rng, n_tokens, head)


def _question(tok: Tokenizer, rng: random.Random, student: int, n_tokens: int) -> str:
    return _text_of_tokens(tok, rng, n_tokens, f"Student {student}: I am stuck.")
