"""Fused residual add + RMSNorm and SiLU * up on CPUs (`norm_act.c`): one pass per row where
eager PyTorch makes several over float32 copies. `supports()` says when they apply; otherwise
the layers run their PyTorch ops."""

from __future__ import annotations

import ctypes
import functools

import torch

from tutorserve.kernels.build import DTYPES, library


def supports(x: torch.Tensor, width: int) -> bool:
    """Whether `x` can go through these kernels as rows of `width` elements each (the kernels
    take widths in multiples of 16)."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and width % 16 == 0
        and x.is_contiguous()
        and _library() is not None
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm(x + residual) * weight, adding into `residual` in place; without a residual,
    RMSNorm(x) * weight. x, residual: [rows, n]; weight: [n], all of x's dtype."""
    lib = _library()
    if lib is None or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError("add_rms_norm needs the CPU kernels and a weight of x's dtype")
    if residual is not None and not (residual.is_contiguous() and residual.shape == x.shape):
        raise ValueError("add_rms_norm needs a contiguous residual shaped like x")
    out = torch.empty_like(x)
    rows, n = x.numel() // x.shape[-1], x.shape[-1]
    with torch.profiler.record_function("tutorserve::add_rms_norm"):
        status = lib.add_rms_norm(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
            out.data_ptr(), rows, n, eps, DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
    if status != 0:
        raise ValueError(f"add_rms_norm cannot run rows of {n} on this CPU")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up] along the last dim → [rows, n]."""
    lib = _library()
    if lib is None:
        raise ValueError("silu_mul needs the CPU kernels")
    n = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype)
    with torch.profiler.record_function("tutorserve::silu_mul"):
        status = lib.silu_mul(
            gate_up.data_ptr(), out.data_ptr(), out.numel() // n, n, DTYPES[gate_up.dtype],
            torch.get_num_threads(),
        )  # fmt: skip
    if status != 0:
        raise ValueError(f"silu_mul cannot run rows of {n} on this CPU")
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = library()
    if lib is None:
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, i32, i32]
    lib.add_rms_norm.restype = i32
    lib.silu_mul.argtypes = [ptr, ptr, i64, i64, i32, i32]
    lib.silu_mul.restype = i32
    return lib
