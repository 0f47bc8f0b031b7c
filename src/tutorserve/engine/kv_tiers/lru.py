"""Byte-budgeted LRU order over block hashes, shared by the RAM and disk tiers.

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
