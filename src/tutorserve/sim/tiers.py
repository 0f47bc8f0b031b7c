"""The host-RAM KV tier in virtual time: the engine's tier policy (what the pool evicts is kept
below it, a finished session turn's blocks are kept ahead of other KV until its TTL, LRU
otherwise; `engine/kv_tiers`) on the engine's own LRU index, holding keys instead of tensors.

It plugs into the engine's `KVCacheManager` where `TieredKVStore` does. A restore is a copy into
the pool inside the step that admits the request, so its time (blocks × `restore_s_per_block`)
is added to that step. The disk tier is not modelled: a RAM tier large enough for the evening's
sessions is the configuration the planner compares.
"""

from __future__ import annotations

from tutorserve.engine.kv_tiers import TierMatch
from tutorserve.engine.kv_tiers.lru import LruIndex


class SimRamTier:
    def __init__(self, capacity_blocks: int, restore_s_per_block: float, session_ttl: float,
                 clock: list[float]) -> None:  # fmt: skip
        self.index = LruIndex(capacity_blocks)  # one unit per block
        self.restore_s_per_block = restore_s_per_block
        self.session_ttl = session_ttl
        self.clock = clock  # [now], set by the replica before each step
        self.restored_blocks = 0  # since the replica last read it (`take_restored`)
        self.hits = 0

    def _store(self, blocks: list[tuple[int, bytes]], expires_at: float) -> None:
        for _, key in blocks:
            if key in self.index:
                self.index.touch(key, expires_at)
                continue
            for victim in self.index.victims(1, self.clock[0]):
                self.index.remove(victim)
            if self.index.capacity_bytes:
                self.index.add(key, 1, expires_at)

    def spill(self, blocks: list[tuple[int, bytes]]) -> None:
        self._store(blocks, 0.0)

    def keep_session(self, blocks: list[tuple[int, bytes]]) -> None:
        self._store(blocks, self.clock[0] + self.session_ttl)

    def match(self, request_id: str, keys: list[bytes]) -> TierMatch:
        out = TierMatch()
        for key in keys:
            if key not in self.index:
                break
            out.keys.append(key)
        return out

    def restore(self, match: TierMatch, block_ids: list[int]) -> None:
        for key in match.keys:
            self.index.touch(key)
        self.restored_blocks += len(match.keys)
        self.hits += len(match.keys)

    def finish_request(self, request_id: str, match: TierMatch | None) -> None:
        """Nothing to count per request here."""

    def take_restored(self) -> float:
        """Seconds of copying the restores since the last call cost."""
        seconds = self.restored_blocks * self.restore_s_per_block
        self.restored_blocks = 0
        return seconds
