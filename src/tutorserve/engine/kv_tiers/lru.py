"""Byte-budgeted LRU order over block hashes, and the part of a tier built on it (shared by the
RAM and disk tiers).

Entries kept for a student session carry an expiry (last use + session TTL). Eviction takes, in
order: session entries past their TTL, then ordinary entries (spilled from the pool) least
recently used first, and only when those run out, live session entries. Session entries are kept
in last-use order with a constant TTL, so the expired ones are always at the head.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from itertools import takewhile

from tutorserve.engine.stats import TierSnapshot


@dataclass(slots=True)
class LruEntry:
    nbytes: int
    expires_at: float = 0.0  # unix time; 0 for an entry no session holds


class LruIndex:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._plain: OrderedDict[bytes, LruEntry] = OrderedDict()
        self._session: OrderedDict[bytes, LruEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._plain) + len(self._session)

    def __contains__(self, key: bytes) -> bool:
        return key in self._plain or key in self._session

    def get(self, key: bytes) -> LruEntry | None:
        return self._plain.get(key) or self._session.get(key)

    def add(self, key: bytes, nbytes: int, expires_at: float = 0.0) -> None:
        self.remove(key)
        entry = LruEntry(nbytes, expires_at)
        (self._session if expires_at else self._plain)[key] = entry
        self.used_bytes += nbytes

    def touch(self, key: bytes, expires_at: float = 0.0) -> None:
        """Mark as just used; a later expiry (a session's new turn) moves it to the session
        order, and an entry never loses a session's expiry by being touched without one."""
        entry = self.get(key)
        if entry is None:
            return
        if expires_at > entry.expires_at:
            self._plain.pop(key, None)
            self._session.pop(key, None)
            entry.expires_at = expires_at
            self._session[key] = entry
        elif key in self._plain:
            # A session entry keeps its place: that order is its expiry order.
            self._plain.move_to_end(key)

    def remove(self, key: bytes) -> LruEntry | None:
        entry = self._plain.pop(key, None) or self._session.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes
        return entry

    def victims(self, incoming: int, now: float | None = None) -> list[bytes]:
        """Keys to evict so that `incoming` more bytes fit (not removed yet)."""
        excess = self.used_bytes + incoming - self.capacity_bytes
        if excess <= 0:
            return []
        now = time.time() if now is None else now
        out: dict[bytes, None] = {}
        expired = (
            k for k, _ in takewhile(lambda ke: ke[1].expires_at <= now, self._session.items())
        )
        for source in (expired, iter(self._plain), iter(self._session)):
            for key in source:
                if excess <= 0:
                    return list(out)
                if key not in out:
                    out[key] = None
                    excess -= self.get(key).nbytes  # type: ignore[union-attr]
        return list(out)


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # blocks found on lookup
    misses: int = 0  # admitted requests whose cacheable prompt the tier did not hold to the end
    bytes_in: int = 0  # written into the tier
    bytes_out: int = 0  # read out of it (restored into the pool, or promoted from disk)
    loads: int = 0  # restores: one request's run of blocks from this tier
    load_seconds: float = 0.0
    errors: int = 0  # corrupt, truncated or foreign entries dropped
    dropped: int = 0  # writes skipped (over budget, or the disk writer falling behind)


class LruTier:
    """A tier's bookkeeping: what it holds (an `LruIndex`) and its counters."""

    name = ""

    def __init__(self, capacity_bytes: int) -> None:
        self.index = LruIndex(capacity_bytes)
        self.stats = TierStats()

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    def __len__(self) -> int:
        return len(self.index)

    def snapshot(self) -> TierSnapshot:
        s = self.stats
        return TierSnapshot(
            self.name, s.hits, s.misses, s.bytes_in, s.bytes_out, s.errors, s.dropped, s.loads,
            s.load_seconds, self.used_bytes, self.capacity_bytes, len(self),
        )  # fmt: skip

    def __contains__(self, key: bytes) -> bool:
        return key in self.index
