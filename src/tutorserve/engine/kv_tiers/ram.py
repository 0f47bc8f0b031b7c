"""The host-RAM tier: block payloads held as CPU tensors under a byte budget."""

from __future__ import annotations

import threading

import torch

from tutorserve.engine.kv_tiers.lru import LruTier


class RamTier(LruTier):
    """Thread-safe: the engine thread spills and restores, the disk reader promotes into it."""

    name = "ram"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._data: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

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
