"""The host-RAM tier: block payloads held as CPU tensors under a byte budget."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tutorserve.engine.kv_tiers.lru import LruIndex


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # blocks found on lookup
    misses: int = 0  # blocks looked up and not found
    bytes_in: int = 0  # written into the tier
    bytes_out: int = 0  # read out of it (restored into the pool, or promoted from disk)
    loads: int = 0  # restores: one request's run of blocks from this tier
    load_seconds: float = 0.0
    errors: int = 0  # corrupt, truncated or foreign entries dropped
    dropped: int = 0  # writes skipped (over budget, or the disk writer falling behind)


class RamTier:
    """Thread-safe: the engine thread spills and restores, the disk reader promotes into it."""

    name = "ram"

    def __init__(self, capacity_bytes: int) -> None:
        self.index = LruIndex(capacity_bytes)
        self.stats = TierStats()
        self._data: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: bytes) -> bool:
        return key in self._data

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            data = self._data.get(key)
            if data is not None:
                self.index.touch(key)
            return data

    def peek(self, key: bytes) -> torch.Tensor | None:
        """The payload without marking it used."""
        return self._data.get(key)

    def touch(self, key: bytes, expires_at: float = 0.0) -> bool:
        with self._lock:
            self.index.touch(key, expires_at)
            return key in self._data

    def put(
        self, key: bytes, data: torch.Tensor, expires_at: float = 0.0
    ) -> list[tuple[bytes, torch.Tensor, float]]:
        """Store a block; returns what was evicted to make room (key, payload, expiry), for the
        caller to pass down to disk."""
        nbytes = data.numel() * data.element_size()
        if nbytes > self.index.capacity_bytes:
            self.stats.dropped += 1
            return []
        with self._lock:
            if key in self._data:
                self.index.touch(key, expires_at)
                return []
            evicted = []
            for victim in self.index.victims(nbytes):
                entry = self.index.remove(victim)
                evicted.append((victim, self._data.pop(victim), entry.expires_at))
            self._data[key] = data
            self.index.add(key, nbytes, expires_at)
            self.stats.bytes_in += nbytes
            return evicted
