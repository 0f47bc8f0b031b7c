"""Paged attention against dense reference attention, including cascade (shared-prefix) decode."""

import logging

import pytest
import torch
import torch.nn.functional as F

from tutorserve.kernels import build, isa
from tutorserve.kernels import paged_attention as kernel
from tutorserve.kernels.paged_attention import paged_attention
from tutorserve.layers.attention import AttentionBatch, PagedAttention, PrefillSpan, StepContext
from tutorserve.layers.attention.context import reset_context, set_context
from tutorserve.layers.attention.cpu_kernel import CPUKernelBackend
from tutorserve.layers.attention.gather import GatherBackend
from tutorserve.layers.attention.selector import select_backend

BS, KVH, GROUP, DIM, BLOCKS = 4, 2, 3, 16, 96


def make_layer(seed=0, kv_dtype=torch.float32):
    """A layer over random caches in `kv_dtype` (a float32 model may store its KV in bf16)."""
    g = torch.Generator().manual_seed(seed)
    attn = PagedAttention(KVH * GROUP, KVH, DIM)
    attn.k_cache = torch.randn(KVH, BLOCKS, BS, DIM, generator=g).to(kv_dtype)
    attn.v_cache = torch.randn(KVH, BLOCKS, BS, DIM, generator=g).to(kv_dtype)
    return attn


def context_kv(attn, table, length):
    """Dense [KVH, length, DIM] K and V of one request, read block by block."""
    k = torch.cat([attn.k_cache[:, b] for b in table], dim=1)[:, :length]
    v = torch.cat([attn.v_cache[:, b] for b in table], dim=1)[:, :length]
    return k, v


def reference_decode(attn, q, k_new, v_new, tables, lens):
    outs = []
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        k, v = context_kv(attn, t, n)
        k[:, n - 1], v[:, n - 1] = k_new[i], v_new[i]  # rounded as the cache stores them
        k, v = k.float(), v.float()
        o = F.scaled_dot_product_attention(
            q[i].unsqueeze(1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), enable_gqa=True
        )
        outs.append(o.reshape(-1))
    return torch.stack(outs)


def slots_of(tables, lens):
    return torch.tensor(
        [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens, strict=True)]
    )


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("share", [True, False])
def test_decode_with_shared_prefixes_matches_dense(share, attention_backend, kv_dtype):
    in_place = isinstance(attention_backend, CPUKernelBackend)
    attn = make_layer(kv_dtype=kv_dtype)
    prefix_a, prefix_b = [1, 2, 3, 4, 5, 6], [9, 10]
    tables = [
        [*prefix_a, 20, 21],
        [*prefix_a, 22],
        [*prefix_a, 23, 24, 25],  # course A
        [*prefix_b, 30],
        [*prefix_b, 31, 32],  # course B
        [40, 41, 42],  # a student alone
        [*prefix_a[:3], 50],  # these two share only part of course A's prefix:
        [*prefix_a[:3], 51, 52],  # they form their own group rather than shorten A's
        list(range(60, 74)),  # a long history of its own: bucketed apart, not padded to
    ]
    lens = [29, 26, 34, 10, 15, 9, 13, 18, 55]
    batch = _check_decode(attn, attention_backend, tables, lens, share, None, seed=1)
    # Gathered suffixes are bucketed by length; read in place, padding costs nothing.
    assert len(batch.buckets) == 1 if in_place else len(batch.buckets) > 1
    if share:
        assert batch.shared is not None
        assert sorted(batch.shared.grouped_rows.tolist()) == [0, 1, 2, 3, 4, 6, 7]
        assert sorted(batch.shared.tables.ne(0).sum(1).tolist()) == [2, 3, 6]
    else:
        assert batch.shared is None


def _step(attn, backend, slots, q, k, v, batch):
    """The layer on one step's queries, the step's metadata built by `backend`; returns the
    output and the metadata."""
    meta = backend.build(batch)
    set_context(StepContext(slot_mapping=slots, backend=backend, attention=meta))
    try:
        return attn(q, k, v), meta
    finally:
        reset_context()


def _check_decode(attn, backend, tables, lens, share, hashes, seed):
    """One decode step through the layer, checked against dense attention; returns its decode
    batch."""
    cpu = torch.device("cpu")
    batch = AttentionBatch(BS, cpu, torch.float32, tables, lens, hashes, [], share)
    g = torch.Generator().manual_seed(seed)
    n = len(tables)
    q = torch.randn(n, KVH * GROUP, DIM, generator=g)
    k_new, v_new = torch.randn(n, KVH, DIM, generator=g), torch.randn(n, KVH, DIM, generator=g)
    ref = reference_decode(attn, q, k_new, v_new, tables, lens)
    out, meta = _step(attn, backend, slots_of(tables, lens), q, k_new, v_new, batch)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    return meta.decode


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [9, 0])
def test_prefill_chunk_after_cached_prefix_matches_dense(cached, attention_backend, kv_dtype):
    in_place = isinstance(attention_backend, CPUKernelBackend)
    attn = make_layer(seed=2, kv_dtype=kv_dtype)
    table, new = [7, 8, 9, 10, 11], 8  # 9 cached tokens (or none) and 8 new ones
    total = cached + new
    g = torch.Generator().manual_seed(3)
    q = torch.randn(new, KVH * GROUP, DIM, generator=g)
    k_new, v_new = torch.randn(new, KVH, DIM, generator=g), torch.randn(new, KVH, DIM, generator=g)
    k, v = (x.float() for x in context_kv(attn, table, total))
    # Attention reads the new K/V back from the cache, rounded to its dtype, except a whole
    # first chunk on the gather path, which attends to them as computed.
    fresh = not in_place and not cached
    k[:, cached:] = k_new.transpose(0, 1) if fresh else k_new.transpose(0, 1).to(kv_dtype)
    v[:, cached:] = v_new.transpose(0, 1) if fresh else v_new.transpose(0, 1).to(kv_dtype)
    mask = torch.arange(total)[None, :] <= torch.arange(cached, total)[:, None]
    ref = (
        F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            enable_gqa=True,
        )
        .squeeze(0)
        .transpose(0, 1)
        .reshape(new, -1)
    )
    pos = torch.arange(cached, total)
    slots = torch.tensor(table)[pos // BS] * BS + pos % BS
    batch = AttentionBatch(
        BS,
        torch.device("cpu"),
        torch.float32,
        [],
        [],
        [],
        [PrefillSpan(0, new, cached, table)],
        True,
    )
    out, _ = _step(attn, attention_backend, slots, q, k_new, v_new, batch)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The new K/V landed in the cache at the slot mapping.
    stored = context_kv(attn, table, total)[0][:, cached:]
    torch.testing.assert_close(stored, k_new.transpose(0, 1).to(kv_dtype))


def _decode_step(attn, backend, tables, lens, hashes, seed):
    """A checked decode step on the gather path; returns the shared-prefix K the backend kept
    for the layer, if any."""
    _check_decode(attn, backend, tables, lens, True, hashes, seed)
    return backend.kept(attn)


def test_shared_prefix_kv_is_reused_while_its_content_is_the_same():
    attn, backend = make_layer(seed=4), GatherBackend()
    prefix = [1, 2, 3]
    tables = [[*prefix, 20, 21], [*prefix, 22]]
    lens = [18, 14]
    hashes = [[b"h1", b"h2", b"h3", b"x"], [b"h1", b"h2", b"h3"]]
    first = _decode_step(attn, backend, tables, lens, hashes, seed=5)
    assert first is not None
    # The next step (one token further): the same prefix, so the gathered K/V is reused.
    second = _decode_step(attn, backend, tables, [19, 15], hashes, seed=6)
    assert second is first
    # The prefix blocks freed and refilled with other content (another course's prompt landing
    # in the same blocks): their hashes differ, so the layer gathers again, and is right.
    attn.k_cache[:, prefix] = torch.randn(KVH, len(prefix), BS, DIM)
    attn.v_cache[:, prefix] = torch.randn(KVH, len(prefix), BS, DIM)
    other = [[b"o1", b"o2", b"o3", b"x"], [b"o1", b"o2", b"o3"]]
    third = _decode_step(attn, backend, tables, [19, 15], other, seed=7)
    assert third is not first
    # Without hashes nothing is kept across steps: every step gathers.
    assert _decode_step(attn, backend, tables, [19, 15], None, seed=8) is None


def test_a_prefix_too_big_to_copy_is_gathered_every_step():
    attn, backend = make_layer(seed=9), GatherBackend()  # 96 blocks: a quarter is 24 blocks
    prefix = list(range(1, 31))
    tables = [[*prefix, 40], [*prefix, 41]]
    hashes = [[bytes([i]) for i in range(31)], [bytes([i]) for i in range(30)]]
    assert _decode_step(attn, backend, tables, [123, 122], hashes, seed=10) is None
    small = [[*prefix[:12], 40], [*prefix[:12], 41]]
    assert _decode_step(attn, backend, small, [51, 50], hashes, seed=11) is not None


def test_rotary_looks_positions_up_once_per_step_and_never_reuses_another_steps():
    from tutorserve.layers.rotary import RotaryEmbedding

    # float64: the PyTorch ops, not the kernel (which rotates in place, caching nothing)
    rope = RotaryEmbedding(DIM, 64, 10000.0).double()
    g = torch.Generator().manual_seed(12)
    q = torch.randn(3, 4, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(3, 2, DIM, generator=g, dtype=torch.float64)

    def fresh(pos):
        cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
        half = DIM // 2

        def rot(x):
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

        return rot(q), rot(k)

    step1, step2 = torch.tensor([0, 5, 9]), torch.tensor([1, 6, 10])
    for pos in (step1, step1, step2, step1.clone()):  # the second call reuses the first's lookup
        got, want = rope(pos, q, k), fresh(pos)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    got = rope(step2, q.float(), k.float())  # another dtype: looked up again, in that dtype
    assert got[0].dtype == torch.float32


def qkv_views(tokens, heads, kv_heads, dim, dtype, seed):
    """q, k, v as the model has them: views into one fused projection's output rows."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return (
        q.view(tokens, heads, dim),
        k.view(tokens, kv_heads, dim),
        v.view(tokens, kv_heads, dim),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_kernel_matches_the_pytorch_ops(cpu_isa, dtype, table_dtype):
    """In place on views into the QKV output; bf16 bit for bit (the same roundings), float32
    within an ulp (the kernel may fuse a product and a sum)."""
    from tutorserve.kernels import rotary
    from tutorserve.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 512, 10000.0).to(table_dtype)
    q, k, _ = qkv_views(37, 9, 3, 64, dtype, seed=5)
    positions = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(6))
    positions[:2] = torch.tensor([0, 511])
    cos = rope.cos[positions].unsqueeze(1).to(dtype)
    sin = rope.sin[positions].unsqueeze(1).to(dtype)

    def reference(x):
        return x * cos + torch.cat((-x[..., 32:], x[..., :32]), -1) * sin

    want_q, want_k = reference(q), reference(k)
    assert rotary.supports(q, k, rope.cos)
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    tol = 0 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="out of range"):
        rotary.rotary_embedding(torch.tensor([512] * 37), q, k, rope.cos, rope.sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_the_kv_write_kernel_matches_index_copy(cpu_isa, dtype, kv_dtype):
    _, k, v = qkv_views(20, 6, KVH, DIM, dtype, seed=7)
    slots = torch.randperm(BLOCKS * BS, generator=torch.Generator().manual_seed(8))[:20]
    got, want = make_layer(9, kv_dtype), make_layer(9, kv_dtype)
    assert kernel.supports_write(k, v, got.k_cache)
    kernel.write_kv(k, v, slots, got.k_cache, got.v_cache)
    for cache, new in ((want.k_cache, k), (want.v_cache, v)):
        cache.view(KVH, -1, DIM).index_copy_(1, slots, new.transpose(0, 1).to(kv_dtype))
    assert torch.equal(got.k_cache, want.k_cache) and torch.equal(got.v_cache, want.v_cache)
    bad = slots.clone()
    bad[-1] = BLOCKS * BS  # one past the cache: refused before anything is written
    with pytest.raises(ValueError, match="outside the cache"):
        kernel.write_kv(k + 1, v + 1, bad, got.k_cache, got.v_cache)
    assert torch.equal(got.k_cache, want.k_cache) and torch.equal(got.v_cache, want.v_cache)
    assert not kernel.supports_write(k.double(), v.double(), got.k_cache)  # PyTorch writes it


DTYPE_PAIRS = {  # (queries, K/V cache)
    "f32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "f32-q-bf16-kv": (torch.float32, torch.bfloat16),  # bf16 storage, float32 math
}


def _random_sets(dtypes, block_size, queries, dim, seed=13):
    """Five key sets (1 key, a partial block, exactly full blocks, many blocks) over a shuffled
    cache, with `queries` queries per KV head each."""
    qdt, kvdt = dtypes
    g = torch.Generator().manual_seed(seed)
    kvh, blocks = 2, 64
    k_cache = torch.randn(kvh, blocks, block_size, dim, generator=g).to(kvdt)
    v_cache = torch.randn(kvh, blocks, block_size, dim, generator=g).to(kvdt)
    lens = [1, block_size - 1, block_size, 3 * block_size, 5 * block_size + 2]
    order = torch.randperm(blocks, generator=g).tolist()
    tables = [order[6 * r : 6 * r + -(-n // block_size)] for r, n in enumerate(lens)]
    q = torch.randn(len(lens), kvh, queries, dim, generator=g).to(qdt)
    table_t = torch.tensor([t + [0] * (6 - len(t)) for t in tables])
    return q, k_cache, v_cache, tables, table_t, lens


def _tolerance(dtypes):
    """bf16 queries with a bf16 cache may take the bf16 dot-product path (AVX512-BF16), which
    rounds probabilities to bf16 as flash attention does; every other case is float32 math on
    the same (rounded) inputs."""
    return 2e-2 if dtypes == DTYPE_PAIRS["bf16"] else 1e-5


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS.values(), ids=DTYPE_PAIRS.keys())
@pytest.mark.parametrize(
    ("block_size", "queries", "dim"),
    [
        (16, 3, 64),
        (16, 24, 64),
        (4, 1, 16),
        (8, 5, 128),
        (32, 4, 32),
        (16, 37, 64),
        (16, 6, 64),
        (16, 7, 128),
    ],
)
def test_the_cpu_kernel_matches_dense_attention_and_its_log_sum_exp(
    cpu_isa, dtypes, block_size, queries, dim
):
    """The C kernel at each ISA level reads blocks where they lie: sets of 1 key, a partial
    block, exactly full blocks and many blocks, several queries per set (a GQA group, or a
    course's students; the bf16 path takes them four at a time, then the 1-3 left), against
    softmax attention in float64 on the same (rounded) K/V."""
    q, k_cache, v_cache, tables, table_t, lens = _random_sets(dtypes, block_size, queries, dim)
    kvh, scale = k_cache.shape[0], dim**-0.5
    out, lse = paged_attention(q, k_cache, v_cache, table_t, torch.tensor(lens), scale)
    tol = _tolerance(dtypes)
    for r, (t, n) in enumerate(zip(tables, lens, strict=True)):
        k = k_cache[:, t].reshape(kvh, -1, dim)[:, :n].double()
        v = v_cache[:, t].reshape(kvh, -1, dim)[:, :n].double()
        scores = q[r].double() @ k.transpose(-1, -2) * scale  # [kvh, queries, n]
        want = torch.softmax(scores, -1) @ v
        torch.testing.assert_close(out[r].double(), want, atol=tol, rtol=tol)
        want_lse = torch.logsumexp(scores, -1)
        torch.testing.assert_close(lse[r].double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS.values(), ids=DTYPE_PAIRS.keys())
@pytest.mark.parametrize(("kvh", "threads", "n"), [(3, 2, 1000), (1, 4, 1000), (1, 4, 300)])
def test_a_decode_with_few_kv_heads_takes_its_keys_in_parts(cpu_isa, dtypes, kvh, threads, n):
    """The kernel takes keys in parts of 256 and merges them by their log-sum-exps, so batch 1
    (a few KV heads) gives every thread work: 4 parts for 1,000 keys, 2 for 300 (the second
    short), on a shuffled cache; against float64."""
    qdt, kvdt = dtypes
    g = torch.Generator().manual_seed(n + kvh)
    blocks, block_size, dim, scale = 80, 16, 64, 0.125
    k_cache = torch.randn(kvh, blocks, block_size, dim, generator=g).to(kvdt)
    v_cache = torch.randn(kvh, blocks, block_size, dim, generator=g).to(kvdt)
    table = torch.randperm(blocks, generator=g)[: -(-n // block_size)]
    q = torch.randn(1, kvh, 3, dim, generator=g).to(qdt)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = paged_attention(q, k_cache, v_cache, table[None], torch.tensor([n]), scale)
    finally:
        torch.set_num_threads(before)
    k = k_cache[:, table].reshape(kvh, -1, dim)[:, :n].double()
    v = v_cache[:, table].reshape(kvh, -1, dim)[:, :n].double()
    scores = q[0].double() @ k.transpose(-1, -2) * scale
    tol = _tolerance(dtypes)
    torch.testing.assert_close(out[0].double(), torch.softmax(scores, -1) @ v, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[0].double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


def _with_threads(threads, fn, *args):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS.values(), ids=DTYPE_PAIRS.keys())
def test_a_querys_result_does_not_depend_on_what_else_the_call_computes(cpu_isa, dtypes):
    """Bit for bit, a token's attention is the same alone, beside other rows (shorter, and
    longer: more parts than its own), on other thread counts, and as the first of five tokens
    of a causal span (a token verified with its speculative drafts): greedy speculative decoding
    equals plain decoding only if it is. Positions around the 256-key parts and 16-key tiles."""
    qdt, kvdt = dtypes
    g = torch.Generator().manual_seed(21)
    kvh, group, bs, blocks, dim, drafts = 3, 3, 16, 160, 64, 4
    k_cache = torch.randn(kvh, blocks, bs, dim, generator=g).to(kvdt)
    v_cache = torch.randn(kvh, blocks, bs, dim, generator=g).to(kvdt)
    order = torch.randperm(blocks, generator=g)
    table, others = order[:50], [order[50:53], order[53:113]]  # 800 keys; 40 and 950 beside
    for pos in (15, 254, 255, 256, 511, 600):
        span_len = pos + 1 + drafts
        q = torch.randn(1, kvh, (1 + drafts) * group, dim, generator=g).to(qdt)
        span, span_lse = _with_threads(
            2, paged_attention, q, k_cache, v_cache, table[None], torch.tensor([span_len]),
            dim**-0.5, torch.tensor([pos]), group,
        )  # fmt: skip
        first = q[:, :, :group]
        alone = _with_threads(
            2, paged_attention, first, k_cache, v_cache, table[None], torch.tensor([pos + 1]),
            dim**-0.5,
        )  # fmt: skip
        rows = torch.cat([torch.randn(1, kvh, group, dim, generator=g).to(qdt), first,
                          torch.randn(1, kvh, group, dim, generator=g).to(qdt)])  # fmt: skip
        tables = torch.zeros(3, 60, dtype=torch.int64)  # past a set's blocks: never read
        for r, t in enumerate((others[0], table, others[1])):
            tables[r, : len(t)] = t
        batched = _with_threads(
            3, paged_attention, rows, k_cache, v_cache, tables,
            torch.tensor([40, pos + 1, 950]), dim**-0.5,
        )  # fmt: skip
        for out, lse in (alone, (batched[0][1:2], batched[1][1:2])):
            assert torch.equal(out, span[:, :, :group]), pos
            assert torch.equal(lse, span_lse[:, :, :group]), pos


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS.values(), ids=DTYPE_PAIRS.keys())
def test_every_level_matches_the_scalar_kernel(cpu_isa, dtypes):
    """The SIMD levels against the plain-C reference on the same inputs, at the head sizes the
    kernels specialise (64, 128) and one they do not (48)."""
    for dim in (64, 128, 48):
        args = _random_sets(dtypes, 16, 7, dim, seed=dim)
        q, k_cache, v_cache, _, table_t, lens = args
        call = (q, k_cache, v_cache, table_t, torch.tensor(lens), dim**-0.5)
        out, lse = paged_attention(*call)
        with isa.use("scalar"):
            want, want_lse = paged_attention(*call)
        tol = _tolerance(dtypes)
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS.values(), ids=DTYPE_PAIRS.keys())
@pytest.mark.parametrize("dim", [64, 32])
def test_the_cpu_kernel_attends_causally_for_prefill_chunks(cpu_isa, dtypes, dim):
    """Causal sets: a chunk of 21 tokens whose first sits at position 30, its 3 query heads
    per KV head folded into 63 queries: each sees the keys up to its own position only."""
    qdt, kvdt = dtypes
    g = torch.Generator().manual_seed(14)
    kvh, group, bs, blocks, start, n = 2, 3, 16, 8, 30, 21
    k_cache = torch.randn(kvh, blocks, bs, dim, generator=g).to(kvdt)
    v_cache = torch.randn(kvh, blocks, bs, dim, generator=g).to(kvdt)
    table = [5, 2, 7, 0]
    total = start + n
    q = torch.randn(1, kvh, n * group, dim, generator=g).to(qdt)
    out, _ = paged_attention(
        q, k_cache, v_cache, torch.tensor([table]), torch.tensor([total]), dim**-0.5,
        torch.tensor([start]), group,
    )  # fmt: skip
    k = k_cache[:, table].reshape(kvh, -1, dim)[:, :total].double()
    v = v_cache[:, table].reshape(kvh, -1, dim)[:, :total].double()
    scores = q[0].double() @ k.transpose(-1, -2) * dim**-0.5  # [kvh, n * group, total]
    pos = start + torch.arange(n * group) // group
    scores[:, torch.arange(total)[None, :] > pos[:, None]] = float("-inf")
    want = torch.softmax(scores, -1) @ v
    tol = _tolerance(dtypes)
    torch.testing.assert_close(out[0].double(), want, atol=tol, rtol=tol)


def _written_both_ways(block_size, dim, kvh, n, seed):
    """n random keys and values written by `write_kv` into bf16 caches at the slots of a
    shuffled table, as rows and paired; caches start as NaN, so a kernel that weighed an
    unwritten slot would say so. → table, row caches, paired caches."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n // block_size) + 3
    shape = (kvh, blocks, block_size, dim)
    caches = [torch.full(shape, float("nan"), dtype=torch.bfloat16) for _ in range(4)]
    k, v = (torch.randn(n, kvh, dim, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(blocks, generator=g)[: -(-n // block_size)]
    slots = table[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
    kernel.write_kv(k, v, slots, caches[0], caches[1])
    kernel.write_kv(k, v, slots, caches[2], caches[3], paired_kv=True)
    return table, caches[:2], caches[2:]


@pytest.mark.parametrize(("block_size", "dim"), [(16, 64), (32, 128), (64, 64)])
def test_a_paired_cache_lies_as_the_bf16_dot_product_reads_it(bf16_dot_isa, block_size, dim):
    """Within a block, K's word c of key j (its dims 2c, 2c + 1) at word c × block_size + j;
    V's dim d of keys 2m, 2m + 1 at word m × dim + d."""
    kvh, n = 2, 3 * block_size - 5
    _, (k_rows, v_rows), (k_paired, v_paired) = _written_both_ways(block_size, dim, kvh, n, 3)
    blocks = k_rows.shape[1]
    k_unpaired = k_paired.view(kvh, blocks, dim // 2, block_size, 2).transpose(2, 3)
    v_unpaired = v_paired.view(kvh, blocks, block_size // 2, dim, 2).transpose(3, 4)
    bits = torch.int16  # NaN where neither wrote, the same bits
    assert torch.equal(k_unpaired.reshape(k_rows.shape).view(bits), k_rows.view(bits))
    assert torch.equal(v_unpaired.reshape(v_rows.shape).view(bits), v_rows.view(bits))


@pytest.mark.parametrize(("block_size", "dim", "group"), [(16, 64, 3), (32, 128, 7), (64, 64, 4)])
def test_attention_over_paired_kv_equals_it_over_rows(bf16_dot_isa, block_size, dim, group):
    """The same products in the same order, bit for bit: decode rows of one key to several
    parts (over 256 keys), and a causal prefill chunk."""
    kvh = 2
    for n in (1, 5, block_size, block_size + 1, 300, 700):
        table, rows, paired = _written_both_ways(block_size, dim, kvh, n, n)
        g = torch.Generator().manual_seed(n)
        q = torch.randn(1, kvh, group, dim, generator=g).bfloat16()
        args = (table[None].contiguous(), torch.tensor([n]), dim**-0.5)
        want = paged_attention(q, *rows, *args)
        got = paged_attention(q, *paired, *args, paired_kv=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), n
        chunk = min(n, 9)  # its last tokens, causal
        q = torch.randn(1, kvh, chunk * group, dim, generator=g).bfloat16()
        causal = (torch.tensor([n - chunk]), group)
        want = paged_attention(q, *rows, *args, *causal)
        got = paged_attention(q, *paired, *args, *causal, paired_kv=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), n


def test_a_cache_is_paired_where_the_bf16_dot_product_reads_it(bf16_dot_isa):
    """bf16 model and cache, head size 64 or 128, blocks of a multiple of 16: paired, and the
    CPU backend writes and reads it so; anything else keeps rows, and the kernel refuses a
    paired cache it would not read as such."""
    cpu, bf16, f32 = torch.device("cpu"), torch.bfloat16, torch.float32
    assert kernel.pairs_kv(bf16, bf16, 64, 16) and kernel.pairs_kv(bf16, bf16, 128, 32)
    assert not kernel.pairs_kv(f32, bf16, 64, 16)  # float32 queries: the float32 path
    assert not kernel.pairs_kv(bf16, bf16, 32, 16)
    assert not kernel.pairs_kv(bf16, bf16, 64, 8)
    assert select_backend(cpu, bf16, bf16, 64, 16).paired_kv
    assert not select_backend(cpu, f32, bf16, 64, 16).paired_kv
    with isa.use("avx512"):  # no bf16 dot product
        assert not kernel.pairs_kv(bf16, bf16, 64, 16)
    table, _, paired = _written_both_ways(16, 64, 1, 20, 0)
    q = torch.randn(1, 1, 3, 64)
    with pytest.raises(ValueError, match="paired"):
        paged_attention(q, *paired, table[None].contiguous(), torch.tensor([20]), 0.125,
                        paired_kv=True)  # fmt: skip
    kv, f32_cache = q[0].transpose(0, 1), torch.zeros(1, 2, 16, 64)
    with pytest.raises(ValueError, match="bfloat16"):
        kernel.write_kv(kv, kv, torch.arange(3), f32_cache, f32_cache.clone(), paired_kv=True)


def test_the_best_level_this_cpu_runs_is_built_and_used_for_attention(monkeypatch):
    """`make test` runs where a C compiler is (the Makefile sees to it): the kernels must build
    at the best level the CPU runs and be chosen for CPU attention at the head sizes they
    handle."""
    monkeypatch.delenv(isa.ENV, raising=False)
    levels = isa.cpu_levels()
    assert levels[0] == "scalar"
    if levels == ["scalar"]:
        pytest.skip("no SIMD level on this CPU: PyTorch's ops run (the scalar kernels on request)")
    assert isa._choose().level == levels[-1]
    cpu = torch.device("cpu")
    assert kernel.supports(cpu, torch.bfloat16, 64)
    assert kernel.supports(cpu, torch.float32, 16)
    assert not kernel.supports(cpu, torch.float16, 64)
    assert not kernel.supports(cpu, torch.float32, 24)  # not a multiple of 16
    assert not kernel.supports(torch.device("meta"), torch.float32, 64)
    # The runner's choice: the kernel where it takes the model's and the cache's dtypes.
    assert isinstance(select_backend(cpu, torch.float32, torch.bfloat16, 64, 16), CPUKernelBackend)
    assert isinstance(select_backend(cpu, torch.float16, torch.bfloat16, 64, 16), GatherBackend)
    meta = torch.device("meta")
    assert isinstance(select_backend(meta, *[torch.float32] * 2, 64, 16), GatherBackend)


def test_the_override_forces_a_lower_level_and_refuses_what_the_cpu_lacks(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=isa.__name__)
    levels = isa.cpu_levels()
    for level in levels:
        monkeypatch.setenv(isa.ENV, level)
        chosen = isa._choose()
        assert chosen.level == level
        assert chosen.lib.tutorserve_level() == isa.LEVELS.index(level)
    assert f"CPU kernels: {levels[0]}" in caplog.text  # which level runs is logged
    monkeypatch.setenv(isa.ENV, "avx1024")
    with pytest.raises(ValueError, match="choose one of scalar, neon, avx2"):
        isa._choose()
    # A level above the CPU's (simulated: a CPU that runs scalar only) is a warning, not SIGILL;
    # with no SIMD level left, PyTorch's ops run (scalar C is slower than they are).
    monkeypatch.setenv(isa.ENV, "avx2")
    monkeypatch.setattr(isa, "cpu_levels", lambda: ["scalar"])
    assert isa._choose() is None
    assert "this CPU runs only scalar" in caplog.text
    monkeypatch.setenv(isa.ENV, "scalar")
    assert isa._choose().level == "scalar"
    with pytest.raises(ValueError, match="cannot run the avx2 kernels"):
        isa.use("avx2").__enter__()


def test_a_compiler_without_a_levels_intrinsics_costs_only_that_level(
    monkeypatch, tmp_path, caplog
):
    """An old compiler that cannot build AVX-512 code (simulated by a wrapper that rejects the
    flags): a warning, and the best level below runs."""
    levels = isa.cpu_levels()
    if not {"avx2", "avx512"} <= set(levels):
        pytest.skip(f"needs a CPU that runs avx2 and avx512 (this one runs: {', '.join(levels)})")
    wrapper = tmp_path / "old-cc"
    wrapper.write_text(
        '#!/bin/sh\nfor a; do case "$a" in -mavx512*) echo "unknown $a" >&2; exit 1;; esac; done\n'
        'exec cc "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.delenv(isa.ENV, raising=False)
    build.load.cache_clear()
    try:
        assert isa._choose().level == "avx2"
        assert "building the avx512 CPU kernels failed" in caplog.text
    finally:
        build.load.cache_clear()


def test_without_a_working_compiler_attention_gathers_blocks(monkeypatch, tmp_path, caplog):
    """A compiler that fails, or a cache directory that cannot be written, is a warning and
    the gather path, never an error at engine start."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert build._build("scalar") is None
    assert "building the scalar CPU kernels failed" in caplog.text
    monkeypatch.setenv("CC", "cc")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert build._build("scalar") is None
    assert not list(tmp_path.glob("**/*.so"))
    build.load.cache_clear()
    try:  # with nothing built, nothing is chosen: callers take their PyTorch paths
        assert isa.cpu_levels() == [] and isa._choose() is None
    finally:
        build.load.cache_clear()
