"""Fused residual add + RMSNorm and SiLU * up on CPUs (`norm_act.c`): one pass per row where
eager PyTorch makes several over float32 copies. `supports()` says when they apply; otherwise
the layers run their PyTorch ops."""

from __future__ import annotations

import torch

from tutorserve.kernels import isa
from tutorserve.kernels.build import DTYPES, Kernels, threads_for, traced


def supports(x: torch.Tensor, width: int) -> bool:
    """Whether `x` can go through these kernels as rows of `width` elements each (the kernels
    take widths in multiples of 16, every level's vector width)."""
    return (
        x.is_cpu
        and x.dtype in DTYPES
        and width % 16 == 0
        and x.is_contiguous()
        and isa.active() is not None
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm(x + residual) * weight, adding into `residual` in place; without a residual,
    RMSNorm(x) * weight. x, residual: [rows, n]; weight: [n], all of x's dtype."""
    kernels = _kernels()
    if weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError("add_rms_norm needs a contiguous weight of x's dtype")
    if residual is not None and not (residual.is_contiguous() and residual.shape == x.shape):
        raise ValueError("add_rms_norm needs a contiguous residual shaped like x")
    out = torch.empty_like(x)
    rows, n = x.numel() // x.shape[-1], x.shape[-1]
    with traced("tutorserve::add_rms_norm"):
        status = kernels.lib.add_rms_norm(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
            out.data_ptr(), rows, n, eps, DTYPES[x.dtype], threads_for(rows * n),
        )  # fmt: skip
    if status != 0:
        raise ValueError(f"add_rms_norm cannot run rows of {n}")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up] along the last dim → [rows, n]."""
    kernels = _kernels()
    n = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype)
    with traced("tutorserve::silu_mul"):
        status = kernels.lib.silu_mul(
            gate_up.data_ptr(), out.data_ptr(), out.numel() // n, n, DTYPES[gate_up.dtype],
            threads_for(out.numel()),
        )  # fmt: skip
    if status != 0:
        raise ValueError(f"silu_mul cannot run rows of {n}")
    return out


def _kernels() -> Kernels:
    kernels = isa.active()
    if kernels is None:
        raise ValueError("the fused CPU kernels are not available")
    return kernels
