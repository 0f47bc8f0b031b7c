"""BlockPool (refcounts, LRU free list, prefix-cache map) and KVCacheManager (chained hashes,
prefix matching, all-or-nothing allocation, freeing)."""

import hashlib
import random
from array import array
from collections import Counter

import pytest

from tutorserve.engine.kv_cache_manager import KVCacheManager
from tutorserve.engine.sequence import Sequence
from tutorserve.paging import BlockPool, hash_block
from tutorserve.sampling_params import SamplingParams

BS = 4


def make_seq(tokens, salt=b"", rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(), cache_salt=salt)


def h(i):
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def compute(kv, seq, n):
    """What the engine does after a step that computed `n` tokens of `seq`."""
    seq.num_computed_tokens += n
    assert seq.num_computed_tokens <= seq.num_tokens
    kv.cache_computed_blocks(seq)


def admit(kv, seq, n=None):
    """Prefix-match and allocate like the scheduler's admission; returns the hit blocks."""
    hits = kv.match_prefix(seq)
    if n is None:
        n = seq.num_tokens - len(hits) * kv.block_size
    assert kv.allocate(seq, n, hits)
    seq.num_computed_tokens = len(hits) * kv.block_size
    return hits


def pool_state(pool):
    return (
        [(b.ref_count, b.block_hash) for b in pool.blocks],
        list(pool.free),
        dict(pool.cached),
        pool.num_evictions,
    )


# ---- BlockPool ---------------------------------------------------------------------------


def test_allocate_release_refcounts():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    assert ids == [0, 1]
    assert [pool.blocks[i].ref_count for i in ids] == [1, 1]
    assert pool.num_free == 2
    pool.touch([0])
    assert pool.blocks[0].ref_count == 2
    pool.release([0])
    assert pool.blocks[0].ref_count == 1
    assert 0 not in pool.free
    pool.release([1, 0])
    assert pool.num_free == 4
    assert all(b.ref_count == 0 for b in pool.blocks)
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_over_release_raises():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.release([0])
    with pytest.raises(RuntimeError):
        pool.release([0])


def test_freed_blocks_go_to_tail_in_lru_order_and_keep_hash():
    pool = BlockPool(6)
    ids = pool.allocate(4)
    for i in ids:
        pool.register(i, h(i))
    assert list(pool.free) == [4, 5]
    pool.release([2, 0, 3, 1])
    assert list(pool.free) == [4, 5, 2, 0, 3, 1]
    for i in ids:
        assert pool.blocks[i].block_hash == h(i)
        assert pool.lookup(h(i)) == i
    assert pool.num_cached_free == 4
    pool.check_integrity()


def test_touch_takes_idle_cached_block_out_of_free_list():
    pool = BlockPool(5)
    ids = pool.allocate(5)
    for i in ids:
        pool.register(i, h(i))
    pool.release(ids)
    # The free list is a mapping (O(1) removal from the middle), not a list to scan.
    assert isinstance(pool.free, dict)
    pool.touch([2])
    assert list(pool.free) == [0, 1, 3, 4]
    assert pool.blocks[2].ref_count == 1
    assert pool.lookup(h(2)) == 2
    pool.touch([2])  # a second holder: nothing left to remove
    assert pool.blocks[2].ref_count == 2
    assert list(pool.free) == [0, 1, 3, 4]
    pool.release([2, 2])
    assert list(pool.free) == [0, 1, 3, 4, 2]  # re-freed at the most-recent end
    pool.check_integrity()


def test_reallocation_evicts_lru_block_and_drops_its_hash():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    for i in ids:
        pool.register(i, h(i))
    pool.release([1, 2, 0])
    assert pool.num_evictions == 0
    (got,) = pool.allocate(1)
    assert got == 1  # least recently freed
    assert pool.blocks[1].block_hash is None
    assert pool.lookup(h(1)) is None
    assert h(1) not in pool.cached
    assert pool.num_evictions == 1
    assert pool.lookup(h(2)) == 2 and pool.lookup(h(0)) == 0
    pool.check_integrity()


def test_a_block_freed_without_a_hash_is_taken_before_any_cached_block_is_evicted():
    """Slots of drafts the model rejected (or a partial last block) hold nothing to hit: an
    allocation takes them first. Taking them last, each rejected draft that crossed a block
    boundary would evict a cached prefix block while garbage waited at the tail."""
    pool = BlockPool(4)
    cached = pool.allocate(3)
    for i in cached:
        pool.register(i, h(i))
    pool.release(cached)
    (draft_slots,) = pool.allocate(1)  # the last free block, no hash: evicts nothing
    assert pool.num_evictions == 0
    pool.release([draft_slots])
    assert pool.allocate(1) == [draft_slots]
    assert pool.num_evictions == 0 and all(pool.lookup(h(i)) == i for i in cached)
    pool.check_integrity()


def test_duplicate_registration_keeps_first_and_evicting_duplicate_keeps_map_entry():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.register(a, h(7))
    pool.register(b, h(7))  # same content computed twice (e.g. admitted in the same step)
    assert pool.lookup(h(7)) == a
    pool.register(a, h(8))  # a block is published once: later registrations are ignored
    assert pool.blocks[a].block_hash == h(7)
    assert pool.lookup(h(8)) is None
    pool.release([b, a])
    pool.allocate(3)  # evicts the two never-used blocks, then b
    assert pool.blocks[b].block_hash is None
    assert pool.lookup(h(7)) == a  # b's eviction must not drop a's entry
    pool.check_integrity()
    pool.allocate(1)  # evicts a
    assert pool.lookup(h(7)) is None
    pool.check_integrity()


def test_check_integrity_detects_corruption():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.check_integrity()
    pool.blocks[0].ref_count = 0  # held per the free list, but ref 0
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool.blocks[0].ref_count = 1
    pool.cached[h(1)] = 2  # map entry for a block that does not carry that hash
    with pytest.raises(AssertionError):
        pool.check_integrity()


# ---- hashes ------------------------------------------------------------------------------


def test_hash_block_matches_reference_and_is_chained():
    tokens = [5, 6, 7, 8]
    ref = hashlib.blake2b(b"", digest_size=16)
    ref.update(array("i", tokens).tobytes())
    assert hash_block(b"", tokens) == ref.digest()
    assert hash_block(b"", tokens) == hash_block(b"", list(tokens))
    p1, p2 = hash_block(b"", [1, 2, 3, 4]), hash_block(b"", [1, 2, 3, 9])
    assert hash_block(p1, tokens) != hash_block(p2, tokens)
    assert hash_block(p1, tokens) != hash_block(b"", tokens)
    assert hash_block(b"", tokens, b"adapter-a") != hash_block(b"", tokens)
    assert hash_block(b"", tokens, b"adapter-a") != hash_block(b"", tokens, b"adapter-b")
    assert hash_block(b"", [1, 0]) != hash_block(b"", [256])
    assert len(hash_block(b"", tokens)) == 16


def test_sequence_hashes_depend_on_whole_prefix_and_salt():
    kv = KVCacheManager(16, BS, True)
    a = make_seq([1, 2, 3, 4, 9, 9, 9, 9, 0])
    b = make_seq([1, 2, 3, 5, 9, 9, 9, 9, 0])
    c = make_seq([1, 2, 3, 4, 9, 9, 9, 9, 0], salt=b"s")
    for s in (a, b, c):
        kv.match_prefix(s)  # fills block_hashes for the full blocks
        assert len(s.block_hashes) == 2
    assert a.block_hashes[1] != b.block_hashes[1]  # same block, different parent
    assert a.block_hashes[0] != c.block_hashes[0]
    assert a.block_hashes[1] != c.block_hashes[1]
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], [9, 9, 9, 9])


def test_salted_request_does_not_hit_unsalted_cache():
    kv = KVCacheManager(16, BS, True)
    prompt = list(range(1, 14))
    a = make_seq(prompt)
    admit(kv, a)
    compute(kv, a, a.num_tokens)
    assert kv.match_prefix(make_seq(prompt, salt=b"x")) == []
    assert kv.match_prefix(make_seq(prompt)) == a.block_table[:3]


# ---- prefix matching ---------------------------------------------------------------------


@pytest.mark.parametrize("enable", [True, False])
def test_match_prefix_never_covers_last_token(enable):
    kv = KVCacheManager(16, BS, enable)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    a = make_seq(prompt)
    admit(kv, a)
    compute(kv, a, a.num_tokens)
    assert a.num_registered_blocks == (3 if enable else 0)
    table = list(a.block_table)
    kv.free(a)
    exact = kv.match_prefix(make_seq(prompt))
    longer = kv.match_prefix(make_seq([*prompt, 7]))
    if enable:
        assert exact == table[:2]
        assert longer == table[:3]
    else:
        assert exact == [] and longer == []


def test_match_prefix_returns_held_blocks_in_order_and_stops_at_first_miss():
    kv = KVCacheManager(16, BS, True)
    a = make_seq(list(range(1, 14)))  # 3 full blocks + 1
    admit(kv, a)
    compute(kv, a, a.num_tokens)
    table = list(a.block_table)
    assert kv.match_prefix(make_seq(list(range(1, 14)))) == table[:3]
    assert kv.match_prefix(make_seq([*range(1, 9), 0, 0, 0, 0, 0])) == table[:2]
    assert kv.match_prefix(make_seq([0, *range(2, 14)])) == []
    # Drop the head block's entry: later blocks are still cached but unreachable.
    del kv.pool.cached[a.block_hashes[0]]
    assert kv.match_prefix(make_seq(list(range(1, 14)))) == []


def test_prefix_hit_reuses_blocks_and_takes_references():
    kv = KVCacheManager(8, BS, True)
    a = make_seq(list(range(1, 10)))  # 9 tokens: 2 full blocks + 1
    admit(kv, a)
    compute(kv, a, a.num_tokens)
    assert kv.num_free_blocks == 5
    b = make_seq([*range(1, 9), 50, 51, 52, 53, 54])  # 13 tokens sharing two blocks with a
    hits = admit(kv, b)
    assert hits == a.block_table[:2]
    assert b.block_table[:2] == hits
    assert b.num_computed_tokens == 8
    assert [kv.pool.blocks[i].ref_count for i in hits] == [2, 2]
    assert len(b.block_table) == 4
    assert kv.num_free_blocks == 3  # only b's two new blocks were taken
    kv.pool.check_integrity()


# ---- allocation --------------------------------------------------------------------------


def test_allocate_counts_chunks_and_partial_blocks():
    kv = KVCacheManager(8, BS, False)
    s = make_seq(list(range(10)))
    assert kv.allocate(s, 3)
    assert len(s.block_table) == 1
    s.num_computed_tokens = 3
    assert kv.allocate(s, 1)  # token 4 still fits in block 0
    assert len(s.block_table) == 1
    s.num_computed_tokens = 4
    assert kv.allocate(s, 6)  # tokens 5..10 → blocks 1 and 2
    assert len(s.block_table) == 3
    assert kv.num_used_blocks == 3


def test_allocate_short_pool_returns_false_and_changes_nothing():
    kv = KVCacheManager(4, BS, True)
    a = make_seq(list(range(1, 12)))  # 11 tokens → 3 blocks
    admit(kv, a)
    b = make_seq(list(range(50, 56)))  # 6 tokens → 2 blocks, only 1 free
    before = pool_state(kv.pool)
    assert not kv.allocate(b, b.num_tokens)
    assert b.block_table == []
    assert pool_state(kv.pool) == before
    assert kv.allocate(b, 4)  # a chunk that fits one block does succeed
    assert kv.num_free_blocks == 0


def test_allocate_counts_idle_hit_blocks_against_free_space():
    kv = KVCacheManager(4, BS, True)
    a = make_seq(list(range(1, 10)))  # 9 tokens: registers 2 full blocks
    admit(kv, a)
    compute(kv, a, a.num_tokens)
    kv.free(a)
    assert kv.num_free_blocks == 4
    assert kv.pool.num_cached_free == 2

    # 17 tokens: 2 hit blocks (idle, in the free list) + 3 new ones = 5 > 4 blocks.
    big = make_seq([*range(1, 9), *range(60, 69)])
    hits = kv.match_prefix(big)
    assert len(hits) == 2
    before = pool_state(kv.pool)
    assert not kv.allocate(big, big.num_tokens - 8, hits)  # must not raise, must not touch
    assert big.block_table == []
    assert pool_state(kv.pool) == before

    # 13 tokens: 2 idle hits + 2 new = exactly the pool.
    fit = make_seq([*range(1, 9), *range(60, 65)])
    hits = kv.match_prefix(fit)
    assert kv.allocate(fit, fit.num_tokens - 8, hits)
    assert fit.block_table[:2] == hits
    assert kv.num_free_blocks == 0
    assert sorted(fit.block_table) == [0, 1, 2, 3]
    assert kv.pool.num_evictions == 0  # the hit blocks were not evicted for the new ones
    kv.pool.check_integrity()


def test_allocate_held_hits_do_not_reduce_free_space():
    kv = KVCacheManager(5, BS, True)
    a = make_seq(list(range(1, 10)))  # 3 blocks held, 2 full ones registered
    admit(kv, a)
    compute(kv, a, a.num_tokens)
    b = make_seq([*range(1, 9), *range(60, 65)])  # 13 tokens: 2 held hits + 2 new
    hits = kv.match_prefix(b)
    assert len(hits) == 2
    assert kv.allocate(b, b.num_tokens - 8, hits)
    assert kv.num_free_blocks == 0


def test_free_releases_tail_blocks_first_so_heads_survive_eviction():
    kv = KVCacheManager(6, BS, True)
    a = make_seq(list(range(1, 14)))  # 13 tokens → 4 blocks, 3 registered
    admit(kv, a)
    compute(kv, a, a.num_tokens)
    table = list(a.block_table)
    kv.free(a)
    assert a.block_table == [] and a.num_registered_blocks == 0
    # Registered blocks tail first at the free list's end; the partial tail block at its head.
    free = list(kv.pool.free)
    assert free[-3:] == table[2::-1] and free[0] == table[3]
    # Take the tail block (no hash), the two never-used blocks and block 2: one eviction.
    filler = make_seq(list(range(200, 216)))
    assert kv.allocate(filler, 16)
    assert kv.pool.num_evictions == 1
    again = make_seq([*range(1, 14), 0])
    assert kv.match_prefix(again) == table[:2]


def test_no_leak_after_freeing_everything():
    kv = KVCacheManager(10, BS, True)
    seqs = [make_seq([1, 2, 3, 4, 5, 6, 7, 8, i], rid=str(i)) for i in range(3)]
    for s in seqs:
        admit(kv, s)
        compute(kv, s, s.num_tokens - s.num_computed_tokens)
    assert kv.pool.blocks[seqs[0].block_table[0]].ref_count == 3
    for s in seqs:
        kv.free(s)
    assert kv.num_free_blocks == kv.pool.num_blocks == 10
    assert kv.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
    kv.pool.check_integrity()


# ---- randomized ----------------------------------------------------------------------------


class KVModel:
    """Drives a KVCacheManager at random and checks it against what the KV memory must hold:
    every computed position of a live request reads back K/V written for that exact prefix."""

    def __init__(self, kv, rng):
        self.kv, self.rng = kv, rng
        self.live = []
        self.written = {}  # (block, slot) → the token prefix whose last K/V sits there
        self.count = 0
        self.bases = [[rng.randrange(1, 6) for _ in range(12)] for _ in range(3)]

    def new_seq(self):
        rng = self.rng
        base = rng.choice(self.bases)
        extra = [rng.randrange(1, 6) for _ in range(rng.randrange(4))]
        tokens = base[: rng.randrange(1, 13)] + extra
        salt = rng.choice([b"", b"", b"lora"])
        self.count += 1
        return make_seq(tokens, salt=salt, rid=str(self.count))

    def step(self):
        rng, kv, bs = self.rng, self.kv, self.kv.block_size
        op = rng.random()
        if op < 0.3 or not self.live:
            seq = self.new_seq()
            hits = kv.match_prefix(seq)
            left = seq.num_tokens - len(hits) * bs
            assert left >= 1
            n = rng.randrange(1, left + 1)
            before = pool_state(kv.pool)
            if kv.allocate(seq, n, hits):
                seq.num_computed_tokens = len(hits) * bs
                self.run(seq, n)
                self.live.append(seq)
            else:
                assert pool_state(kv.pool) == before
                assert seq.block_table == []
        elif op < 0.75:
            seq = rng.choice(self.live)
            left = seq.num_tokens - seq.num_computed_tokens
            n = rng.randrange(1, left + 1)
            before = pool_state(kv.pool)
            if kv.allocate(seq, n):
                self.run(seq, n)
            else:
                assert pool_state(kv.pool) == before
        else:
            seq = self.live.pop(rng.randrange(len(self.live)))
            kv.free(seq)
        self.check()

    def run(self, seq, n):
        bs = self.kv.block_size
        start = seq.num_computed_tokens
        assert len(seq.block_table) * bs >= start + n
        for p in range(start, start + n):
            block = seq.block_table[p // bs]
            assert self.kv.pool.blocks[block].ref_count == 1, "writing into a shared block"
            self.written[block, p % bs] = (seq.cache_salt, tuple(seq.token_ids[: p + 1]))
        compute(self.kv, seq, n)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(self.rng.randrange(1, 6))

    def check(self):
        pool, bs = self.kv.pool, self.kv.block_size
        pool.check_integrity()
        held = Counter(b for s in self.live for b in s.block_table)
        for block in pool.blocks:
            assert block.ref_count == held[block.block_id]
        assert pool.num_free == pool.num_blocks - len(held)
        for s in self.live:
            for p in range(s.num_computed_tokens):
                want = (s.cache_salt, tuple(s.token_ids[: p + 1]))
                assert self.written[s.block_table[p // bs], p % bs] == want
        for block_hash, block_id in pool.cached.items():
            assert pool.blocks[block_id].block_hash == block_hash


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_operations_keep_integrity_and_kv_contents(seed):
    kv = KVCacheManager(12, BS, True)
    model = KVModel(kv, random.Random(seed))
    for _ in range(600):
        model.step()
    assert kv.pool.num_evictions > 0  # the pool was small enough to recycle cached blocks
    assert any(len(kv.match_prefix(model.new_seq())) for _ in range(50))
    for seq in model.live:
        kv.free(seq)
    model.live = []
    model.check()
    assert kv.num_free_blocks == kv.pool.num_blocks
