"""Replies cached by pedagogy: a hint at rung r for problem p after diagnosis d does not depend
on who asked, so it is written once per (course version, problem, KC, rung, diagnosis label,
CEFR, model, prompt version) and served from memory afterwards.

What goes in is only ever computed from what the key names: the cacheable prompts
(`prompts.explain_messages(..., pedagogical=True)`) carry neither the learner's words nor their
history. The one exception says so in its key: a diagnosis of a wrong answer depends on the
answer, so its key carries the answer's normalized text (`said`), and only a learner who typed
the same answer shares it. A course edit changes its version: old entries miss, and are dropped
when the first entry of the new version is stored.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace

from tutorserve.tutor.courses import Course

# Bump when a cacheable prompt or the way a reply is checked changes: old replies then miss.
PROMPT_VERSION = "p1"
_versions: dict[int, tuple[Course, str]] = {}


def course_version(course: Course) -> str:
    """A hash of everything in the course (material, problems, hints): any edit changes it."""
    known = _versions.get(id(course))
    if known is not None and known[0] is course:
        return known[1]
    version = hashlib.sha256(course.model_dump_json().encode()).hexdigest()[:16]
    _versions[id(course)] = (course, version)
    return version


def normalized(text: str) -> str:
    return " ".join(re.findall(r"[\w.^/+=-]+", text.lower()))


@dataclass(frozen=True, slots=True)
class ReplyKey:
    agent: str
    course: str
    course_version: str
    problem: str
    kc: str  # the problem's KCs, joined
    rung: int
    label: str
    cefr: str
    model: str
    prompt_version: str = PROMPT_VERSION
    said: str = ""  # the learner's own (normalized) words, only where the reply depends on them

    def with_model(self, model: str) -> ReplyKey:
        """The key under the model that actually wrote the reply (a breaker may have moved
        the call down a tier)."""
        return replace(self, model=model)


@dataclass(frozen=True, slots=True)
class CachedReply:
    text: str  # "" when the model's reply was rejected: the authored text serves
    tokens: int  # what writing it cost (prompt + generated), saved by each later hit


class ReplyCache:
    """An LRU map of `ReplyKey` → `CachedReply`, with hit counts and tokens saved per agent.

    A class asks the same thing at once: thirty students reach the same hint together. So a
    missing reply is written by one call only (single flight, as a CDN collapses requests);
    the others asking for its key meanwhile wait for it and count as hits."""

    def __init__(self, max_entries: int = 50_000) -> None:
        if max_entries < 1:
            raise ValueError("the reply cache needs room for at least one entry")
        self.max_entries = max_entries
        self._entries: OrderedDict[ReplyKey, CachedReply] = OrderedDict()
        self._course_versions: dict[str, str] = {}
        self._lock = threading.Lock()
        self._writing: dict[ReplyKey, asyncio.Future[ReplyKey | None]] = {}
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.saved_tokens: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: ReplyKey) -> CachedReply | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses[key.agent] += 1
                return None
            self._entries.move_to_end(key)
            self.hits[key.agent] += 1
            self.saved_tokens[key.agent] += found.tokens
            return found

    async def lookup(self, key: ReplyKey) -> CachedReply | None:
        """The reply under `key`, waiting for it while another call writes it. None: this call
        is the one to write it, and must call `fill` with the reply or, failing, `written`
        (then the next waiter writes it)."""
        while (writing := self._writing.get(key)) is not None:
            stored = await asyncio.shield(writing)
            if stored is not None and (found := self.get(stored)) is not None:
                return found
        found = self.get(key)
        if found is None:
            self._writing[key] = asyncio.get_running_loop().create_future()
        return found

    def fill(self, asked: ReplyKey, model: str, reply: CachedReply) -> None:
        """Store what the writer of `asked` got from `model` and hand it to the calls waiting
        on `asked`. When a breaker moved the writer down a tier, its waiters would have been
        moved down too: they take its reply rather than each waiting on the failing model in
        turn."""
        stored = asked.with_model(model)
        self.put(stored, reply)
        self._wake(asked, stored)

    def written(self, key: ReplyKey) -> None:
        """The writer of `key` is done without a reply: its waiters look again."""
        self._wake(key, None)

    def _wake(self, key: ReplyKey, stored: ReplyKey | None) -> None:
        writing = self._writing.pop(key, None)
        if writing is not None and not writing.done():
            writing.set_result(stored)

    def put(self, key: ReplyKey, reply: CachedReply) -> None:
        with self._lock:
            if self._course_versions.get(key.course) != key.course_version:
                self._course_versions[key.course] = key.course_version
                stale = [k for k in self._entries if k.course == key.course]
                for k in stale:
                    if k.course_version != key.course_version:
                        del self._entries[k]
            self._entries[key] = reply
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                "hits": dict(self.hits),
                "misses": dict(self.misses),
                "saved_tokens": dict(self.saved_tokens),
            }
