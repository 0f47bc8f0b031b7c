"""Matmul and dequantization on GGUF-quantized weight rows (`quant.c`: dequantization, and the
matmul's entry into `quant_x8.c` and `quant_rows16.c`), for the formats in
`FORMATS` (ggml type id → weights per block, bytes per block). A `_R16` format is its GGUF
format's blocks repacked sixteen rows at a time (`repack16`, `quant_rows16.c`): the same bytes,
laid out so that a vector lane computes one output row. On such rows (and Q8_0's) `bind_gemm`
is the bf16 GEMM for many activation rows (`quant_gemm.c`), where the CPU has the bf16 dot
product."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tutorserve.kernels import isa
from tutorserve.kernels.build import BF16_DOT_LEVELS, DTYPES, Kernels, traced

FORMATS = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "Q4_0_R16": (256 | 2, 32, 18),
    "Q4_1_R16": (256 | 3, 32, 20),
    "Q5_0_R16": (256 | 6, 32, 22),
    "Q8_0_R16": (256 | 8, 32, 34),
    "Q4_K_R16": (256 | 12, 256, 144),
    "Q6_K_R16": (256 | 14, 256, 210),
}
REPACKED = {fmt: f"{fmt}_R16" for fmt in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")}


def available() -> bool:
    return isa.active() is not None


def matmul(
    blocks: torch.Tensor, fmt: str, k: int, x: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [B, k] @ W^T, W the rows of `blocks` ([n, bytes per row] uint8) → [B, n]; x float32 or
    bfloat16 with contiguous rows; written into `out` (a [B, n] view of float32 or bfloat16,
    rows may be further apart) when given, else a new float32 tensor."""
    n = blocks.shape[0]
    if x.dtype not in DTYPES or x.stride(-1) != 1:
        raise ValueError("quant matmul takes float32 or bfloat16 activations with contiguous rows")
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
    if out.dtype not in DTYPES or out.stride(-1) != 1:
        raise ValueError("quant matmul writes float32 or bfloat16 rows")
    bind_matmul(blocks, fmt, k)(x, out)
    return out


def bind_matmul(
    blocks: torch.Tensor, fmt: str, k: int
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`matmul` on these rows as a call (x, out) → None with the format looked up once, for a
    layer that calls it every step; x and out as `matmul` takes them, not checked again. The
    rows' address is read at each call, so `blocks` may be a parameter whose data moves."""
    fid, n, name = FORMATS[fmt][0], blocks.shape[0], f"tutorserve::quant_matmul_{fmt}"

    def call(x: torch.Tensor, out: torch.Tensor) -> None:
        with traced(name):
            status = _kernels().lib.quant_matmul(
                blocks.data_ptr(), fid, n, k, x.data_ptr(), DTYPES[x.dtype], x.shape[0],
                x.stride(0), out.data_ptr(), DTYPES[out.dtype], out.stride(0),
                torch.get_num_threads(),
            )  # fmt: skip
        if status != 0:
            _check(status, fmt, k)

    return call


def has_gemm(fmt: str, n: int) -> bool:
    """Whether `bind_gemm` runs here on `n` rows of `fmt`: a repacked format or Q8_0 in GGUF's
    layout, rows in sixteens, and kernels with the bf16 dot product."""
    kernels = isa.active()
    formats = {"Q8_0", *REPACKED.values()}
    return (
        fmt in formats and n % 16 == 0 and kernels is not None and kernels.level in BF16_DOT_LEVELS
    )


def bind_gemm(
    blocks: torch.Tensor, fmt: str, k: int
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """x [B, k] @ W^T as a call (x, out) → None, as `bind_matmul`'s but for bf16 activations
    only, on the weight dequantized to bf16 sixteen rows at a time (the dequantized model's
    arithmetic: `quant_gemm.c`); for a format `has_gemm` accepts."""
    fid, n, name = FORMATS[fmt][0], blocks.shape[0], f"tutorserve::quant_gemm_{fmt}"

    def call(x: torch.Tensor, out: torch.Tensor) -> None:
        with traced(name):
            status = _kernels().lib.quant_gemm(
                blocks.data_ptr(), fid, n, k, x.data_ptr(), x.shape[0], x.stride(0),
                out.data_ptr(), DTYPES[out.dtype], out.stride(0), torch.get_num_threads(),
            )  # fmt: skip
        if status != 0:
            _check(status, fmt, k)

    return call


def dequantize(
    blocks: torch.Tensor,
    fmt: str,
    k: int,
    dtype: torch.dtype = torch.float32,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight rows (all, or those `rows` names) as a [n, k] tensor of `dtype`."""
    ids = None if rows is None else rows.to(torch.int64).contiguous()
    n = blocks.shape[0] if ids is None else ids.numel()
    if out is None:
        out = torch.empty(n, k, dtype=dtype)
    if out.dtype not in DTYPES or not out.is_contiguous():
        raise ValueError("quant dequantize writes contiguous float32 or bfloat16")
    status = _kernels().lib.quant_dequantize(
        blocks.data_ptr(), FORMATS[fmt][0], k, None if ids is None else ids.data_ptr(), n,
        out.data_ptr(), DTYPES[out.dtype], torch.get_num_threads(),
    )  # fmt: skip
    _check(status, fmt, k)
    return out


def repack16(blocks: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """Rows of `fmt` blocks (a key of REPACKED; a multiple of 16 rows) in the repacked layout,
    as a tensor of the same shape."""
    out = torch.empty_like(blocks)
    status = _kernels().lib.quant_repack16(
        blocks.contiguous().data_ptr(), FORMATS[fmt][0], blocks.shape[0], k, out.data_ptr()
    )
    if status != 0:
        raise ValueError(f"cannot repack {blocks.shape[0]} {fmt} rows of {k} by sixteen")
    return out


def _check(status: int, fmt: str, k: int) -> None:
    if status == -1:
        raise ValueError(f"{fmt} rows of {k} weights are not whole blocks")
    if status == -3:
        raise ValueError("these kernels have no bf16 dot product for the quant GEMM")
    if status != 0:
        raise MemoryError("quant kernel could not allocate its row buffers")


def _kernels() -> Kernels:
    kernels = isa.active()
    if kernels is None:
        raise ValueError("the CPU quant kernels are not available")
    return kernels
