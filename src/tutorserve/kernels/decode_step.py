"""A decode step's decoder layers in one C call (`decode_step.c`): the layer-by-layer kernels
in a C loop, for a Llama-shaped decoder whose projections are quantized blocks. The caller
describes the layers once (`Layer`, `Linear`, `Shape`, plain ctypes structures of pointers
and sizes, valid while the tensors they point into live) and calls `decode_layers` each step."""

from __future__ import annotations

import ctypes

import torch

from tutorserve.kernels import isa
from tutorserve.kernels.build import DTYPES, PARALLEL_WORK, traced
from tutorserve.kernels.paged_attention import cache_format
from tutorserve.kernels.quant import FORMATS

MAX_PARTS = 4

_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class Linear(ctypes.Structure):
    _fields_ = [
        ("blocks", _ptr * MAX_PARTS),
        ("rows", _i64 * MAX_PARTS),
        ("fmt", _i32 * MAX_PARTS),
        ("parts", _i32),
        ("bias", _ptr),
        ("gemm_rows", _i64),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", Linear),
        ("o", Linear),
        ("gate_up", Linear),
        ("down", Linear),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
    ]


class Shape(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                    "num_blocks", "block_size", "max_positions", "parallel_work")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("is_bf16", _i32),
        ("cache_format", _i32),
        ("table_bf16", _i32),
        ("cos", _ptr),
        ("sin", _ptr),
    ]  # fmt: skip


class Shared(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("groups", "members", "width", "grouped")),
        *((name, _ptr) for name in ("rows", "tables", "lens", "member_slots", "grouped_rows")),
    ]


class Span(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("start", "end", "width")),
        *((name, _ptr) for name in ("table", "kv_len", "q_start")),
    ]


def spans(chunks: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> ctypes.Array:
    """Rows computing several tokens this step, causal over their context: (start, end) in
    the step's rows, and int64 tensors table [blocks] (through this step's tokens), kv_len [1]
    (keys after this step), q_start [1] (position of the first token). Valid while they live."""
    if any(t.dtype != torch.int64 or not t.is_contiguous() for c in chunks for t in c[2:]):
        raise ValueError("spans are described by contiguous int64 tensors")
    return (Span * len(chunks))(*(
        Span(start, end, table.shape[0], table.data_ptr(), kv_len.data_ptr(), q_start.data_ptr())
        for start, end, table, kv_len, q_start in chunks
    ))  # fmt: skip


def shared(
    rows: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    member_slots: torch.Tensor,
    grouped_rows: torch.Tensor,
) -> Shared:
    """Decode rows that share a cached prefix, for one step, all int64 and contiguous: rows
    [groups, members] (each member's decode row, padded with 0), tables [groups, width] (the
    prefix blocks), lens [groups] (prefix keys), member_slots and grouped_rows [grouped] (each
    grouped row's group * members + member, and its decode row). Valid while they live."""
    if any(t.dtype != torch.int64 or not t.is_contiguous()
           for t in (rows, tables, lens, member_slots, grouped_rows)):  # fmt: skip
        raise ValueError("shared prefixes are described by contiguous int64 tensors")
    return Shared(
        groups=rows.shape[0], members=rows.shape[1], width=tables.shape[1],
        grouped=grouped_rows.shape[0], rows=rows.data_ptr(), tables=tables.data_ptr(),
        lens=lens.data_ptr(), member_slots=member_slots.data_ptr(),
        grouped_rows=grouped_rows.data_ptr(),
    )  # fmt: skip


def linear(
    parts: list[tuple[torch.Tensor, str]], bias: torch.Tensor | None, gemm_rows: int
) -> Linear:
    """A projection of quantized parts ([rows, bytes per row] uint8 blocks, format), stacked
    along the output; above `gemm_rows` rows, bf16 activations take the bf16 GEMM
    (`quant.bind_gemm`: every part a format `quant.has_gemm` accepts)."""
    if not 0 < len(parts) <= MAX_PARTS:
        raise ValueError(f"a projection takes 1 to {MAX_PARTS} parts")
    bias_ptr = None if bias is None else bias.data_ptr()
    out = Linear(parts=len(parts), bias=bias_ptr, gemm_rows=gemm_rows)
    for i, (blocks, fmt) in enumerate(parts):
        out.blocks[i], out.rows[i], out.fmt[i] = blocks.data_ptr(), blocks.shape[0], FORMATS[fmt][0]
    return out


def decoder_shape(
    *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
    dtype: torch.dtype, k_cache: torch.Tensor, paired_kv: bool, cos: torch.Tensor,
    sin: torch.Tensor,
) -> Shape:  # fmt: skip
    """The decoder's sizes; `k_cache` one layer's [kv_heads, blocks, block_size, head_dim]
    cache (paired or not, `paged_attention.pairs_kv`), `cos`/`sin` the rotary
    tables [max_positions, head_dim]."""
    return Shape(
        hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, num_blocks=k_cache.shape[1], block_size=k_cache.shape[2],
        max_positions=cos.shape[0], parallel_work=PARALLEL_WORK, eps=eps,
        scale=head_dim**-0.5, is_bf16=DTYPES[dtype],
        cache_format=cache_format(k_cache, paired_kv), table_bf16=DTYPES[cos.dtype],
        cos=cos.data_ptr(), sin=sin.data_ptr(),
    )  # fmt: skip


def decode_layers(
    layers: ctypes.Array,
    shape: Shape,
    x: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    decode: tuple[torch.Tensor, torch.Tensor] | None,
    prefixes: Shared | None = None,
    chunks: ctypes.Array | None = None,
) -> torch.Tensor:
    """Runs the layers over x ([rows, hidden] embedded tokens, contiguous, the model's dtype;
    overwritten with the last layer's MLP output) and returns the residual stream beside it.
    positions, slots: [rows] int64. The first rows are one-token decode rows, with `decode`
    their (tables [decode rows, width] int64, each row's blocks in the cache's layout, as
    `paged_attention` takes them, after a shared prefix the row's own; lens [decode rows]
    int64) and `prefixes` the rows that share one; `chunks` (`spans`) the rest."""
    kernels = isa.active()
    if kernels is None:
        raise RuntimeError("the CPU decode-step kernel is not available")
    tables, lens = (None, None) if decode is None else decode
    if not x.is_contiguous() or (tables is not None and not tables.is_contiguous()):
        raise ValueError("decode_layers needs contiguous rows and block tables")
    ints = [positions, slots] + ([] if lens is None else [lens])
    if any(t.dtype != torch.int64 or t.stride(-1) != 1 for t in ints):
        raise ValueError("decode_layers needs contiguous int64 positions, slots and lengths")
    residual = torch.empty_like(x)
    with traced("tutorserve::decode_layers"):
        status = kernels.lib.decode_layers(
            ctypes.addressof(layers), len(layers), ctypes.addressof(shape), x.data_ptr(),
            residual.data_ptr(), x.shape[0], positions.data_ptr(), slots.data_ptr(),
            0 if tables is None else tables.shape[0], None if tables is None else tables.data_ptr(),
            0 if tables is None else tables.shape[1], None if lens is None else lens.data_ptr(),
            None if prefixes is None else ctypes.addressof(prefixes),
            None if chunks is None else ctypes.addressof(chunks),
            0 if chunks is None else len(chunks), torch.get_num_threads(),
        )  # fmt: skip
    if status == -2:
        raise MemoryError("decode_layers cannot allocate the step's buffer")
    if status != 0:
        raise ValueError("decode_layers: a slot, position or shape the kernels refuse")
    return residual
