"""Test doubles for the tutor: a scripted chat model and courses built from MathDial problems."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from tutorserve.tutor.answers import leaks_answer
from tutorserve.tutor.costs import report_usage
from tutorserve.tutor.courses import KC, Course, Problem

MATHDIAL = Path(__file__).resolve().parents[2] / "shared/data/mathdial/test.jsonl"
GENERIC_HINTS = ("What is the question asking you to find?", "Which quantity do you know first?")


def agent_of(messages: list[dict[str, str]]) -> str:
    task = messages[-1]["content"]
    if "Classify the student's mistake" in task:
        return "diagnose"
    if "encouragement" in task:
        return "engage"
    return "explain"


class ScriptedLLM:
    """Replies per agent from `script[agent](messages, attempt)`, in word-sized deltas with
    `delay` seconds before each; records every call and whether it was abandoned early."""

    name = "scripted"

    def __init__(
        self,
        script: dict[str, Callable[[list[dict[str, str]], int], str]] | None = None,
        delay: dict[str, float] | None = None,
    ) -> None:
        self.script = script or {}
        self.delay = delay or {}
        self.calls: list[tuple[str, list[dict[str, str]]]] = []
        self.abandoned = 0
        self.priorities: list[int] = []

    async def stream(
        self, messages: list[dict[str, str]], *, max_tokens: int, temperature: float,
        session_id: str | None, scope: str | None = None, schema: dict | None = None,
        priority: int = 0,
    ) -> AsyncIterator[str]:  # fmt: skip
        agent = agent_of(messages)
        attempt = sum(1 for a, _ in self.calls if a == agent)
        self.calls.append((agent, messages))
        self.priorities.append(priority)
        default = {
            "diagnose": '{"label": "careless", "reason": "a slip."}',
            "engage": "You are improving.",
        }
        text = self.script.get(agent, lambda m, i: default.get(agent, "Think about it."))(
            messages, attempt
        )
        finished = False
        try:
            for word in re.findall(r"\S+\s*", text):
                await asyncio.sleep(self.delay.get(agent, 0.0))
                yield word
            finished = True
        finally:
            if not finished:
                self.abandoned += 1


class CountingLLM(ScriptedLLM):
    """A scripted model that reports token counts as an engine would: one per word."""

    def __init__(self, name: str = "scripted", **kw) -> None:
        super().__init__(**kw)
        self.name = name

    async def stream(self, messages, **kw):
        prompt = sum(len(m["content"].split()) for m in messages)
        out = 0
        try:
            async for word in super().stream(messages, **kw):
                out += 1
                yield word
        finally:
            report_usage(prompt, prompt // 2, out)


def mathdial_rows(n: int) -> list[dict]:
    if not MATHDIAL.is_file():
        raise FileNotFoundError(f"{MATHDIAL} is missing (../shared/data beside the checkout)")
    with MATHDIAL.open() as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def mathdial_answer(row: dict) -> str:
    return row["ground_truth"].strip().splitlines()[-1].strip()


def mathdial_course(n: int = 20) -> Course:
    """A course of MathDial word problems: answers from the ground truth, hints from the
    teachers' own focus/probing moves that do not give the answer away."""
    problems, seen = [], set()
    for row in mathdial_rows(n):
        if row["qid"] in seen:  # one problem, another student's dialogue
            continue
        seen.add(row["qid"])
        answer = mathdial_answer(row)
        probe = Problem(
            id="p", kcs=["word-problems"], text=row["question"], answer=answer,
            hints=list(GENERIC_HINTS), correction=f"The answer is {answer}.",
        )  # fmt: skip
        moves = re.findall(r"Teacher: \((?:focus|probing)\)([^|]+)", row["conversation"])
        safe = [m.strip() for m in moves if not leaks_answer(m, probe)]
        hints = (safe + list(GENERIC_HINTS))[:2]
        problems.append(probe.model_copy(update={"id": f"md{row['qid']}", "hints": hints}))
    kc = KC(id="word-problems", name="Word problems", explanation="Read, plan, compute, check.")
    return Course(
        id="mathdial", title="MathDial word problems", subject="math",
        persona="You are a patient maths tutor.", kcs=[kc], problems=problems,
    )  # fmt: skip
