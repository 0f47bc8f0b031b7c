"""Modelled chat-model endpoints for `bench tutor-scale`: each counts the prompt's tokens with the
real tokenizer, writes a fixed, clean reply of a fixed length per agent, and takes a modelled
time (first-token latency + prefill of the prompt beyond the course prefix + per-token decode,
queued behind a fixed batch width). Token counts are what the tutor would send; latencies are
those of the stated speeds, not of a measured engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tutorserve.tutor.costs import report_usage
from tutorserve.tutor.llm_client import Messages

# Reply lengths in tokens per agent: about what SmolLM2 wrote in `bench tutor` (explain is capped
# at 96, diagnose's JSON at 64, engage at 40).
REPLY_TOKENS = {"diagnose": 24, "explain": 60, "engage": 24}
REPLIES = {
    "diagnose": '{"label": "careless", "reason": "An arithmetic slip in the last step."}',
    "explain": "Look again at how the two parts fit together, step by step. What comes first?",
    "engage": "You are getting steadier at this with every attempt.",
}


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A modelled model server: seconds to first token, per uncached prompt token, per
    generated token; `batch` requests at once (others queue); `hangs`: no call ever answers
    (a wedged backend whose connections stay open)."""

    name: str
    ttft_s: float
    prefill_s: float
    decode_s: float
    batch: int = 32
    hangs: bool = False


# Decode speeds from ../shared/notes/models.md (llama.cpp, batch 1, this machine type): SmolLM2
# 110–119 tok/s, Qwen2.5-0.5B 44–45 tok/s; prefill taken as 20× decode throughput.
SMALL = Endpoint("smollm2-135m", ttft_s=0.05, prefill_s=1 / 2300, decode_s=1 / 115)
LARGE = Endpoint("qwen2.5-0.5b", ttft_s=0.08, prefill_s=1 / 900, decode_s=1 / 45)


def _agent(messages: Messages) -> str:
    task = messages[-1]["content"]
    if "Classify the student's mistake" in task:
        return "diagnose"
    return "engage" if "encouragement" in task else "explain"


class ModelledLLM:
    def __init__(self, spec: Endpoint, tokens: Any, prefixes: dict[str, int]) -> None:
        self.spec, self.name, self.tokens = spec, spec.name, tokens
        self.prefixes = prefixes  # course system prompt → its tokens (the prefix cache's share)
        self.slots = asyncio.Semaphore(spec.batch)
        self.seen: set[str] = set()

    async def stream(self, messages: Messages, *, max_tokens: int, **_: Any) -> AsyncIterator[str]:
        spec = self.spec
        async with self.slots:
            if spec.hangs:
                await asyncio.Event().wait()
            prompt = self.tokens(tuple((m["role"], m["content"]) for m in messages))
            system = messages[0]["content"]
            cached = self.prefixes[system] if system in self.seen else 0
            self.seen.add(system)
            agent = _agent(messages)
            n = min(max_tokens, REPLY_TOKENS[agent])
            await asyncio.sleep(spec.ttft_s + (prompt - cached) * spec.prefill_s)
            words = REPLIES[agent].split(" ")
            for i, w in enumerate(words):
                yield w if i == len(words) - 1 else w + " "
            await asyncio.sleep(n * spec.decode_s)
            report_usage(prompt, cached, n)
