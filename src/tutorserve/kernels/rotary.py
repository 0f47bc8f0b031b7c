"""Rotary position embedding in place on CPUs (`rotary.c`): one pass over a step's query and key
heads where eager PyTorch runs about ten ops, each making a tensor. `supports()` says when it
applies; otherwise the layer runs its PyTorch ops."""

from __future__ import annotations

import torch

from tutorserve.kernels import isa
from tutorserve.kernels.build import DTYPES, threads_for, traced


def supports(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether q and k ([tokens, heads, head_dim] of one dtype, head rows contiguous) can be
    rotated here with a cos or sin `table` like this one."""
    return (
        q.is_cpu
        and q.dtype in DTYPES
        and k.dtype == q.dtype
        and table.dtype in DTYPES
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and isa.active() is not None
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates q [T, heads, dim] and k [T, kv_heads, dim] in place by `positions` ([T] int64);
    cos, sin: [max_positions, dim], the reference's tables (each half repeated)."""
    kernels = isa.active()
    if kernels is None:
        raise ValueError("the CPU rotary kernel is not available")
    if positions.dtype != torch.int64 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rotary_embedding needs int64 positions and contiguous tables")
    positions = positions.contiguous()
    tokens, dim = q.shape[0], q.shape[-1]
    with traced("tutorserve::rotary_embedding"):
        status = kernels.lib.rotary_embedding(
            positions.data_ptr(), q.data_ptr(), k.data_ptr(), tokens, q.shape[1], k.shape[1],
            dim, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.data_ptr(),
            sin.data_ptr(), cos.shape[0], DTYPES[cos.dtype], DTYPES[q.dtype],
            threads_for(tokens * (q.shape[1] + k.shape[1]) * dim),
        )  # fmt: skip
    if status != 0:
        raise ValueError(f"rotary_embedding: head size {dim} is odd, or a position is out of range")
