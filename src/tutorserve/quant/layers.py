"""Linear and embedding layers over quantized weights, for CPUs with our kernels.

Up to `gemv_rows` rows multiply on the blocks directly (`kernels/quant.c`: each row decoded
once, then dotted with every activation row, on int8 activations; rows in sixteens repacked so
that a vector lane computes one output row, `kernels/quant_rows16.c`), reading 4.5-8.5 bits per
weight instead of 16-32.
More rows (prefill chunks, large decode batches) are compute-bound instead. Above `gemm_rows`,
bf16 activations on repacked rows (or Q8_0's, an LM head's) go through the bf16 GEMM
(`kernels/quant_gemm.c`, on CPUs with the bf16 dot product): each sixteen weight rows
dequantized once per call into a panel the CPU's caches hold, never into memory. Otherwise the
weight is dequantized into a scratch buffer the model's layers share, and PyTorch's GEMM runs
on that.
No layer keeps a float copy, but the buffer grows to the largest weight used that way (the LM
head's, when more than 12 rows sample); a layer that finds its own weight still there (the LM
head, when the other layers stay on their blocks) does not dequantize it again. Rewriting it
for every layer makes prefill-sized batches slower than a model dequantized once
(docs/benchmarks/quantization.md). Under `--batch-invariant` every row count stays on the
int8 kernels (`keep_on_blocks`).
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from tutorserve.kernels import quant
from tutorserve.kernels.build import DTYPES
from tutorserve.quant.weight import QuantWeight

# Rows up to which a format multiplies on its blocks (others: GEMV_ROWS_DEFAULT); above, the
# blocks are dequantized for PyTorch's GEMM. Measured crossovers against dequantizing and the
# GEMM (docs/benchmarks/quantization.md): repacked rows keep up to 256 rows, where a whole step
# (the fused C call included) stops gaining by it; one layer alone, hot in cache, crosses over
# earlier (24-256 rows by format), but a step dequantizes every layer's weight in turn, and a
# layer that dequantizes takes the scratch buffer from the LM head.
GEMV_ROWS_DEFAULT = 12
GEMV_ROWS = {fmt: 256 for fmt in quant.REPACKED.values()}
# Rows above which a layer whose parts the bf16 GEMM takes (`quant.has_gemm`) runs it, or
# above its `gemv_rows` if fewer (an LM head in GGUF's Q8_0): one repacked layer alone crosses
# over at 8-24 rows by format and shape (8 Q6_K, 16 Q4_K, 12-24 Q4_1 and Q5_0; quantization.md,
# *A bf16 GEMM on the blocks*); the GEMM then leads at every row count.
GEMM_ROWS = 16


class Scratch:
    """One buffer for the dequantized weight of whichever layer runs now. It remembers whose
    weight it holds: a layer that is the only one using it (the LM head, when 13-256 rows
    sample and the repacked layers stay on their blocks) dequantizes once, not every step."""

    def __init__(self) -> None:
        self._buf = torch.empty(0)
        self._holder: nn.Module | None = None

    def take(
        self, holder: nn.Module, rows: int, cols: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, bool]:
        """A [rows, cols] buffer for `holder`'s weight, and whether it holds that weight already
        (no other layer took the buffer since)."""
        held = self._holder is holder and self._buf.dtype == dtype
        if self._buf.dtype != dtype or self._buf.numel() < rows * cols:
            self._buf = torch.empty(rows * cols, dtype=dtype)
        self._holder = holder
        return self._buf[: rows * cols].view(rows, cols), held


def _blocks(w: QuantWeight) -> nn.Parameter:
    # A frozen parameter, so that `.to(dtype)` leaves it alone and the KV fingerprint samples it.
    return nn.Parameter(w.blocks, requires_grad=False)


class QuantLinear(nn.Module):
    """y = x W^T + b with W given as parts stacked along the output (a fused qkv may mix
    formats: Q4_K_M files keep v in Q6_K)."""

    def __init__(
        self,
        parts: list[QuantWeight],
        bias: torch.Tensor | None,
        scratch: Scratch,
        repack: bool = True,
    ) -> None:
        super().__init__()
        self.in_features = parts[0].in_features
        if any(p.in_features != self.in_features for p in parts):
            raise ValueError("the parts of a fused linear must take the same inputs")
        # Neighbours of one format become one matrix: one kernel call each instead of per part.
        merged: list[QuantWeight] = []
        for p in parts:
            if merged and merged[-1].fmt == p.fmt:
                rows = torch.cat([merged[-1].blocks, p.blocks])
                merged[-1] = QuantWeight(rows, p.fmt, self.in_features)
            else:
                merged.append(p)
        # Rows repacked by sixteen multiply 1.5-3x faster at batch 1-16, and a step keeps up
        # with dequantize + GEMM to 256 rows (kernels/quant_rows16.c; quantization.md); only
        # they have the bf16 GEMM.
        if repack:
            merged = [p.repacked() for p in merged]
        self.fmts = [p.fmt for p in merged]
        self.out_features = sum(p.out_features for p in merged)
        self.blocks = nn.ParameterList(_blocks(p) for p in merged)
        self._cols, start = [], 0
        for p in merged:
            self._cols.append(slice(start, start + p.out_features))
            start += p.out_features
        # Per part its bound kernels (the format looked up once): int8 tiles, and the GEMM.
        self._matmuls = [quant.bind_matmul(b, f, self.in_features) for b, f in self._parts()]
        self.gemv_rows = min(GEMV_ROWS.get(fmt, GEMV_ROWS_DEFAULT) for fmt in self.fmts)
        self.gemm_rows = sys.maxsize
        self._gemms = []
        if all(quant.has_gemm(f, b.shape[0]) for b, f in self._parts()):
            self.gemm_rows = min(GEMM_ROWS, self.gemv_rows)
            self._gemms = [quant.bind_gemm(b, f, self.in_features) for b, f in self._parts()]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.scratch = scratch

    def _parts(self) -> list[tuple[torch.Tensor, str]]:
        return list(zip(self.blocks, self.fmts, strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this ~120 times for a few µs of matmul each: the Python around
        # the kernel is kept to what the call needs (a 2-D input is used as it is; one format,
        # the usual case, writes the whole output without a column view).
        k = self.in_features
        rows = x if x.dim() == 2 else x.reshape(-1, k)
        gemm = rows.shape[0] > self.gemm_rows and rows.dtype == torch.bfloat16
        if rows.shape[0] > self.gemv_rows and not gemm:
            w, held = self.scratch.take(self, self.out_features, k, x.dtype)
            if not held:
                for (blocks, fmt), cols in zip(self._parts(), self._cols, strict=True):
                    quant.dequantize(blocks, fmt, k, out=w[cols])
            y = F.linear(rows, w, self.bias)
        else:
            # The kernels read bf16 activations and write bf16 outputs themselves; a bias is
            # added before the one rounding to the model's dtype.
            xs = rows.contiguous() if rows.dtype in DTYPES else rows.float().contiguous()
            out = x.dtype if x.dtype in DTYPES and self.bias is None else torch.float32
            y = torch.empty(rows.shape[0], self.out_features, dtype=out)
            calls = self._gemms if gemm else self._matmuls
            if len(calls) == 1:
                calls[0](xs, y)
            else:
                for call, cols in zip(calls, self._cols, strict=True):
                    call(xs, y[:, cols])
            if self.bias is not None:
                y += self.bias
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, formats={self.fmts}"


class QuantEmbedding(nn.Module):
    """Token embeddings looked up from quantized rows (a tied LM head shares the weight)."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = _blocks(weight)
        self.fmt, self.embedding_dim, self.dtype = weight.fmt, weight.in_features, dtype

    def weight(self) -> QuantWeight:
        return QuantWeight(self.blocks.data, self.fmt, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = quant.dequantize(
            self.blocks, self.fmt, self.embedding_dim, self.dtype, rows=ids.reshape(-1)
        )
        return flat.view(*ids.shape, self.embedding_dim)


def quantized_blocks(model: nn.Module) -> list[nn.Parameter]:
    """Every quantized layer's blocks in `model` (a tied head's are its embedding's)."""
    blocks = [p for m in model.modules() if isinstance(m, QuantLinear) for p in m.blocks]
    return blocks + [m.blocks for m in model.modules() if isinstance(m, QuantEmbedding)]


def dequantizing_rows(model: nn.Module, dtype: torch.dtype) -> int | None:
    """Tokens per step above which most of `model`'s quantized weight (by elements) is
    dequantized for a GEMM, with activations of `dtype`: such a step pays that once, whatever it
    computes. None when no linear layer is quantized, or when most of the weight never is
    (bf16 activations on repacked rows take the bf16 GEMM instead)."""
    weight: Counter[int] = Counter()
    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            gemm = dtype == torch.bfloat16 and layer.gemm_rows < sys.maxsize
            limit = sys.maxsize if gemm else layer.gemv_rows
            weight[limit] += layer.in_features * layer.out_features
    rows = weight.most_common(1)[0][0] if weight else None
    return None if rows == sys.maxsize else rows


def keep_on_blocks(model: nn.Module) -> None:
    """Every quantized linear multiplies on its int8 kernels at any row count
    (`--batch-invariant`). They sum each activation row alone, in one order whatever the batch
    holds; PyTorch's GEMM on a dequantized weight orders a row's sums by the batch's shape, so in
    bf16 a row's logits, and at a near-tie its token, would depend on its neighbours; the bf16
    GEMM on the blocks sums a row alone too, but another way than the int8 kernels do, so a row
    would still change with the batch's size. ValueError for a model with a linear layer that
    is not on quantized blocks."""
    plain = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if plain:
        raise ValueError(
            f"batch_invariant needs every linear layer on quantized blocks (a GGUF with "
            f"quantization auto on a CPU, or int8/int4): {plain[0]} is not"
        )
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.gemv_rows = m.gemm_rows = sys.maxsize
