"""A streamed reply to speech, sentence by sentence: each sentence is synthesised as soon as its
text has been released to the student (the answer-leak guard has passed it), so the first audio
leaves while the model is still writing the rest. The verdict the tutor opens with ("Not
quite. ") is a sentence of its own, so a turn's first audio does not wait for the model at all.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any

from tutorserve.voice.tts import Synthesizer

log = logging.getLogger(__name__)

# A sentence ends at . ! ? (after any closing quotes or brackets) followed by white space:
# "2.5" and "x = 3." at the very end of the text so far are not ends yet.
_END = re.compile(r"[.!?]+[\"')\]]*\s+")
_LONG = 160  # a clause this long without a full stop is spoken at its last comma


class Sentences:
    """Text deltas in, whole sentences out."""

    def __init__(self) -> None:
        self.pending = ""
        self.said = ""  # everything handed out for speaking since the last reset

    def feed(self, text: str) -> list[str]:
        self.pending += text
        ends = [m.end() for m in _END.finditer(self.pending)]
        if not ends and len(self.pending) > _LONG and (cut := self.pending.rfind(", ")) > 0:
            ends = [cut + 2]
        if not ends:
            return []
        head, self.pending = self.pending[: ends[-1]], self.pending[ends[-1] :]
        cuts = [0, *(e for e in ends if e <= len(head))]
        return self._out([head[a:b] for a, b in pairwise(cuts)])

    def finish(self, reply: str | None = None) -> list[str]:
        """What is left to say once the reply is final. `reply` is the text the tutor kept
        (it drops a sentence the token limit cut off); without it, whatever is pending."""
        if reply is not None and reply.startswith(self.said):
            rest = reply[len(self.said) :]
        else:
            rest = self.pending if reply is None else ""
        self.pending = ""
        return self._out([rest])

    def reset(self) -> None:
        self.pending = self.said = ""

    def _out(self, parts: list[str]) -> list[str]:
        self.said += "".join(parts)
        return [p.strip() for p in parts if p.strip()]


async def speak_events(
    events: AsyncIterator[dict[str, Any]], tts: Synthesizer, voice: str | None = None
) -> AsyncIterator[dict[str, Any]]:
    """The turn's events, unchanged and undelayed, with `audio` events added: {"event":
    "audio", "seq", "text", "sample_rate", "tts_ms", "pcm" (int16 samples)}. After a `reset`,
    audio of the dropped text is dropped too (the client stops playing on `reset`)."""
    out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    todo: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
    generation = 0

    async def read() -> None:
        nonlocal generation
        sentences = Sentences()
        try:
            async for event in events:
                out.put_nowait(event)
                name = event.get("event")
                if name == "delta":
                    said = sentences.feed(event.get("text", ""))
                elif name == "reset":
                    generation += 1
                    sentences.reset()
                    said = []
                elif name == "final":
                    said = sentences.finish(event.get("reply"))
                else:
                    said = []
                for text in said:
                    todo.put_nowait((generation, text))
        finally:
            todo.put_nowait(None)

    async def speak() -> None:
        seq = 0
        while (item := await todo.get()) is not None:
            made_for, text = item
            if made_for != generation:
                continue
            start = time.monotonic()
            try:
                pcm = await asyncio.to_thread(tts.synthesize, text, voice)
            except Exception:  # the text still reaches the student; only its audio is lost
                log.exception("speech synthesis failed for %r", text[:60])
                continue
            if made_for == generation and pcm.size:
                out.put_nowait(
                    {"event": "audio", "seq": seq, "text": text, "sample_rate": tts.sample_rate,
                     "tts_ms": round((time.monotonic() - start) * 1e3, 1), "pcm": pcm}
                )  # fmt: skip
                seq += 1

    async def run() -> None:
        try:
            await asyncio.gather(read(), speak())
        finally:
            out.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (event := await out.get()) is not None:
            yield event
    finally:
        task.cancel()
