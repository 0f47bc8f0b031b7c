"""The pool of KV blocks: reference counts, a free list in LRU order, and the prefix-cache map.

A block whose reference count drops to zero goes to the tail of the free list but keeps its hash,
so a later request with the same prefix can take it back (an O(1) removal from the ordered dict).
New allocations pop from the head, evicting the least recently freed cached block first; a block
freed without a hash goes to the head, since taking it evicts nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_evictions = 0
        # Kept as a count (not a scan of the free list) so /metrics can read it from another
        # thread while the engine mutates the list.
        self.num_cached_free = 0
        # Told which cached blocks an allocation evicts (id, hash), before anyone can overwrite
        # them: the KV tiers copy them out.
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        ids, evicted = [], []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                    evicted.append((block_id, block.block_hash))
                block.block_hash = None
                self.num_evictions += 1
                self.num_cached_free -= 1
            block.ref_count = 1
            ids.append(block_id)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return ids

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest leading run of `hashes` in the cache (a prefix match)."""
        hits = []
        for block_hash in hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
                self.num_cached_free -= block.block_hash is not None
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop references; pass tail blocks first so they are evicted before shared heads. A
        block without a hash (a partial last block, slots of rejected drafts) holds nothing a
        later request can hit: it goes to the head of the free list, to be taken before any
        cached block is evicted."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} released more often than taken")
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.block_hash is None:
                    self.free.move_to_end(block_id, last=False)
                else:
                    self.num_cached_free += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Publish a full, computed block under its chained hash."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.num_cached_free += block.ref_count == 0
        self.cached.setdefault(block_hash, block_id)

    def evict_cached(self) -> int:
        """Drop every free block's prefix-cache entry (telling `on_evict` first); blocks held by
        requests keep theirs. Returns how many were dropped."""
        evicted = []
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                evicted.append((block_id, block.block_hash))
            block.block_hash = None
        self.num_cached_free = 0
        self.num_evictions += len(evicted)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return len(evicted)

    def check_integrity(self) -> None:
        """Every block is either free (ref 0, in the free list) or held (ref > 0, not in it)."""
        for block in self.blocks:
            in_free = block.block_id in self.free
            if (block.ref_count == 0) != in_free:
                raise AssertionError(
                    f"block {block.block_id}: ref {block.ref_count}, free {in_free}"
                )
        cached_free = sum(1 for b in self.free if self.blocks[b].block_hash is not None)
        if cached_free != self.num_cached_free:
            raise AssertionError(
                f"{cached_free} cached free blocks, counted {self.num_cached_free}"
            )
        for block_hash, block_id in self.cached.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"cache map points {block_hash.hex()} at block {block_id}")
