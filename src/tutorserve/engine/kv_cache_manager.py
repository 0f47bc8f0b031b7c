"""What each request may hold of the KV pool: prefix matching, slot allocation, freeing."""

from __future__ import annotations

from tutorserve.engine.kv_tiers import TieredKVStore, TierMatch
from tutorserve.engine.sequence import Sequence
from tutorserve.paging import BlockPool, extend_block_hashes


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        store: TieredKVStore | None = None,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.store = store if enable_prefix_caching else None
        if self.store is not None:
            self.pool.on_evict = self.store.spill

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def _extend_hashes(self, seq: Sequence) -> None:
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.cache_salt)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding this request's leading tokens (at least one token left to compute,
        since sampling needs the last position's logits). Nothing for a request that asked for
        its prompt's log-probabilities: those need every position computed."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        self._extend_hashes(seq)
        return self.pool.cached_prefix(seq.block_hashes[: (seq.num_tokens - 1) // self.block_size])

    def match_tiers(self, seq: Sequence, num_pool_hits: int) -> TierMatch:
        """Blocks in the KV tiers continuing the `num_pool_hits` blocks found in the pool."""
        if self.store is None or seq.params.prompt_logprobs is not None:
            return TierMatch()
        limit = (seq.num_tokens - 1) // self.block_size
        return self.store.match(seq.request_id, seq.block_hashes[num_pool_hits:limit])

    def restore(self, seq: Sequence, start: int, match: TierMatch) -> None:
        """Fill the blocks of `seq` from index `start` (just allocated) with the matched KV and
        publish them, so requests admitted later in this step hit them in the pool."""
        if self.store is None:
            return
        self.store.finish_request(seq.request_id, match)
        if match.keys:
            self.store.restore(match, seq.block_table[start : start + len(match.keys)])

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens (after any prefix hits); False if
        the pool cannot, in which case nothing changes."""
        hits = hits or []
        bs = self.block_size
        total = seq.num_computed_tokens + len(hits) * bs + num_new_tokens
        need = max(0, -(-total // bs) - len(seq.block_table) - len(hits))
        # Hit blocks nobody holds sit in the free list; taking them shrinks what is free.
        idle_hits = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)
        if need > self.pool.num_free - idle_hits:
            return False
        self.pool.touch(hits)
        seq.block_table.extend(hits)
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish blocks whose every token now has its K/V written."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq)
        for i in range(seq.num_registered_blocks, full):
            self.pool.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = full

    def keep_session(self, seq: Sequence) -> None:
        """Write a finished session turn's computed blocks through to the KV tiers."""
        if self.store is None:
            return
        self.store.finish_request(seq.request_id, None)
        if seq.session_id is not None:
            n = seq.num_registered_blocks
            self.store.keep_session(
                list(zip(seq.block_table[:n], seq.block_hashes[:n], strict=True))
            )

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those `seq`'s tokens need: they held slots of drafts the
        model rejected, never full of verified tokens, so never in the prefix cache."""
        keep = -(-seq.num_tokens // self.block_size)
        extra = seq.block_table[keep:]
        if extra:
            del seq.block_table[keep:]
            self.pool.release(list(reversed(extra)))

    def free(self, seq: Sequence) -> None:
        self.pool.release(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.num_registered_blocks = 0
