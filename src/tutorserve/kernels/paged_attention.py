"""Attention over the paged KV cache in place, on CPUs (`paged_attention.c`), and the write of
new tokens' K/V into it (`kv_write.c`).

PyTorch has no CPU op that attends over blocks scattered through a paged cache, so the plain
torch path copies each decode row's blocks into a contiguous tensor first: their K/V bytes are
read, written and read again. The kernel reads them once, in place, at the ISA level `isa`
chose (with the CPU's bfloat16 dot-product instructions where it has them). The cache may be
stored in bfloat16 while queries are float32: the kernel widens K/V as it reads them. A bf16
cache read by the bf16 dot-product path is stored paired (`pairs_kv`, `kv_format.h`): K and V
in the order that path reads them. Without a compiler, `supports()` is False and attention
gathers blocks instead (as it always does on GPUs).
"""

from __future__ import annotations

import torch

from tutorserve.kernels import isa
from tutorserve.kernels.build import BF16_DOT_LEVELS, DTYPES, threads_for, traced

MAX_HEAD_DIM = 256
KV_BF16_PAIRED = 2  # the cache format beyond DTYPES' two (kv_format.h)


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention on this device, cache dtype and head size can run in the kernel."""
    return (
        device.type == "cpu"
        and dtype in DTYPES
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and isa.active() is not None
    )


def pairs_kv(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether a model in `dtype` stores its `kv_dtype` cache of this head and block size with
    K and V paired: where attention takes the bf16 dot-product path, which then loads a tile of
    keys and values as they lie instead of transposing them (`kv_format.h`)."""
    kernels = isa.active()
    return (
        kernels is not None
        and kernels.level in BF16_DOT_LEVELS
        and dtype == kv_dtype == torch.bfloat16
        and head_dim in (64, 128)
        and block_size % 16 == 0
    )


def cache_format(cache: torch.Tensor, paired_kv: bool) -> int:
    """The `cache_format` the kernels take for a cache of this dtype and layout."""
    return KV_BF16_PAIRED if paired_kv else DTYPES[cache.dtype]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    causal: torch.Tensor | None = None,
    group: int = 1,
    paired_kv: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [sets, kv_heads, nq, dim], float32 or bfloat16; caches: [kv_heads, blocks,
    block_size, dim], float32 or bfloat16; tables: [sets, width] int64 (each set's blocks,
    padded); lens: [sets] int64 keys per set → float32 outputs [sets, kv_heads, nq, dim] and
    log-sum-exp [sets, kv_heads, nq]. Every query sees all its set's keys, or with `causal`
    ([sets] int64, the position of the set's first query token) those up to its own position,
    the nq queries being tokens × `group` query heads. `paired_kv`: the cache is paired
    (`pairs_kv`)."""
    kernels = isa.active()
    if kernels is None:
        raise RuntimeError("the CPU attention kernel is not available")
    sets, kvh, nq, dim = q.shape
    _, num_blocks, block_size, _ = k_cache.shape
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES or k_cache.dtype != v_cache.dtype:
        raise ValueError("paged_attention needs float32 or bfloat16 q, and k and v of one dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and tables.is_contiguous()):
        raise ValueError("paged_attention needs contiguous caches and tables")
    if any(t.dtype != torch.int64 for t in (tables, lens, *([] if causal is None else [causal]))):
        raise ValueError("paged_attention needs int64 tables, lens and causal starts")
    q, lens = q.contiguous(), lens.contiguous()
    causal = None if causal is None else causal.contiguous()
    out = torch.empty(sets, kvh, nq, dim, dtype=torch.float32)
    lse = torch.empty(sets, kvh, nq, dtype=torch.float32)
    with traced("tutorserve::paged_attention"):  # named in profiles
        status = kernels.lib.paged_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), None if causal is None else causal.data_ptr(), sets, kvh, nq,
            group, dim, num_blocks, block_size, tables.shape[1], scale, DTYPES[q.dtype],
            cache_format(k_cache, paired_kv), out.data_ptr(), lse.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
    if status == -2:
        raise MemoryError("paged_attention cannot allocate its parts' buffer")
    if status != 0:
        what = " on a paired cache" if paired_kv else ""
        raise ValueError(f"paged_attention cannot run head size {dim}{what} here")
    return out, lse


def supports_write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether `write_kv` can take K and V like these into a cache like this."""
    return (
        k.is_cpu
        and k.dtype in DTYPES
        and v.dtype == k.dtype
        and cache.dtype in DTYPES
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and k.stride(1) == v.stride(1)
        and isa.active() is not None
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    paired_kv: bool = False,
) -> None:
    """Writes k, v ([tokens, kv_heads, dim]) at `slots` ([tokens] int64, block * block_size +
    offset) of one layer's caches ([kv_heads, blocks, block_size, dim], converting to their
    dtype; with `paired_kv`, a bf16 cache paired within each block, `kv_format.h`)."""
    kernels = isa.active()
    if kernels is None:
        raise RuntimeError("the CPU KV write kernel is not available")
    if slots.dtype != torch.int64 or k_cache.dtype != v_cache.dtype:
        raise ValueError("write_kv needs int64 slots and K and V caches of one dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv needs contiguous caches")
    if paired_kv and k_cache.dtype != torch.bfloat16:
        raise ValueError("write_kv pairs bfloat16 caches only")
    slots = slots.contiguous()
    tokens, kvh, dim = k.shape
    with traced("tutorserve::write_kv"):
        status = kernels.lib.write_kv(
            k.data_ptr(), v.data_ptr(), tokens, kvh, dim, k.stride(0), v.stride(0), k.stride(1),
            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.numel() // (kvh * dim), k_cache.shape[2], DTYPES[k.dtype],
            cache_format(k_cache, paired_kv), threads_for(2 * k.numel()),
        )  # fmt: skip
    if status != 0:
        raise ValueError("write_kv: a slot is outside the cache")
