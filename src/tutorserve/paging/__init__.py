"""Paged KV bookkeeping, shared by every paged cache (the engine's and a draft model's): the pool
of blocks with their reference counts, the free list in LRU order and the prefix-cache map, and
the chained block hashes that key it. Plain Python: no tensors, no model."""

from tutorserve.paging.block_pool import BlockPool
from tutorserve.paging.hashing import extend_block_hashes, hash_block

__all__ = ["BlockPool", "extend_block_hashes", "hash_block"]
