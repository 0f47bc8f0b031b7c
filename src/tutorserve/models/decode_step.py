"""The Llama decoder's layers as one C call on small steps (`kernels/decode_step.c`).

With quantized weights a batch-1 step of the default model spent about as long in the Python
around its ~300 kernel calls as in the kernels (docs/benchmarks/quantization.md); the C loop
calls the same kernels with the same arguments, so its hidden states are the layer-by-layer
path's bit for bit (rows that share a course prompt merge the two halves of their attention
in C, which rounds its exponentials like C, not like PyTorch). It takes a step when every
piece has a CPU kernel: attention read in place by the CPU kernel, no token on a LoRA
adapter, projections on quantized blocks at a batch they keep on their blocks (decode rows,
rows verifying speculative drafts, short prefill chunks: 256 tokens in all on repacked
weights, 12 on others; any step under `--batch-invariant`), no per-head q/k norm. Any other
step, or model, runs layer by layer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from tutorserve.kernels import decode_step as kernel
from tutorserve.kernels import paged_attention
from tutorserve.kernels.build import DTYPES
from tutorserve.layers.attention.context import current_context
from tutorserve.layers.attention.cpu_kernel import CPUKernelBackend
from tutorserve.layers.lora import LoRALinear
from tutorserve.quant import QuantLinear


class FusedDecode:
    """Built once per model; the layers are described to C at the first step it takes (once
    the KV cache is bound), and again when the cache, its layout or the model's dtype changes."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self._key: tuple[torch.Tensor, torch.dtype, bool] | None = None
        self._described: _Described | None = None

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(MLP output, residual) of the last layer for the embedded tokens x, or None when
        this step or model is not one the C loop takes."""
        ctx = current_context()
        if ctx is None or ctx.lora is not None or not isinstance(ctx.backend, CPUKernelBackend):
            return None
        key = (self.layers[0].self_attn.attn.k_cache, x.dtype, ctx.backend.paired_kv)
        if self._key is None or self._key[0] is not key[0] or self._key[1:] != key[1:]:
            self._key, self._described = key, _describe(self.layers, x.dtype, key[2])
        described = self._described
        if described is None or x.shape[0] > described.max_rows:
            return None
        decode, prefills = ctx.attention.decode, ctx.attention.prefills
        nd = 0 if decode is None else decode.num_rows
        if nd + sum(p.end - p.start for p in prefills) != x.shape[0]:
            return None
        tables, prefixes, chunks = None, None, None
        if decode is not None:
            bucket, sp = decode.buckets[0], decode.shared
            tables = (bucket.tables, bucket.lens)
            if sp is not None:
                prefixes = kernel.shared(
                    sp.rows, sp.tables, sp.lens, sp.member_slots, sp.grouped_rows
                )
        if prefills:
            chunks = kernel.spans(
                [(c.start, c.end, c.table, c.kv_len, c.q_start) for c in prefills]
            )
        residual = kernel.decode_layers(
            described.layers,
            described.shape,
            x,
            positions,
            ctx.slot_mapping,
            tables,
            prefixes,
            chunks,
        )
        return x, residual


@dataclass(slots=True)
class _Described:
    layers: ctypes.Array  # of kernel.Layer
    shape: kernel.Shape
    max_rows: int  # the most rows every projection keeps on its blocks
    tensors: list[torch.Tensor]  # what the pointers point into, kept alive with them


def _quantized(proj: nn.Module) -> QuantLinear | None:
    # Steps with no token on an adapter leave a LoRA layer's base output as it is.
    base = proj.base if isinstance(proj, LoRALinear) else proj
    return base if isinstance(base, QuantLinear) else None


def _describe(layers: nn.ModuleList, dtype: torch.dtype, paired_kv: bool) -> _Described | None:
    """The layers as the C loop takes them, or None when a piece has no kernel here."""
    first = layers[0]
    attn, rotary = first.self_attn.attn, first.self_attn.rotary
    down = _quantized(first.mlp.down_proj)
    if down is None:
        return None
    hidden, inter = down.out_features, down.in_features
    if (
        not paged_attention.supports(attn.k_cache.device, attn.k_cache.dtype, attn.head_dim)
        or dtype not in DTYPES
        or first.self_attn.qk_norm
        or rotary.cos.dtype not in DTYPES
        or hidden % 16  # the norm and SiLU·up kernels' row widths (norm_act.supports)
        or inter % 16
    ):
        return None
    described, max_rows, tensors = [], [], [rotary.cos, rotary.sin]
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        projs = [_quantized(p) for p in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None or len(p.fmts) > kernel.MAX_PARTS for p in projs):
            return None
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        biases = [p.bias for p in projs if p.bias is not None]
        if any(t.dtype != dtype for t in norms + biases):
            return None
        max_rows += [p.gemv_rows for p in projs]
        linears = [
            kernel.linear(list(zip(p.blocks, p.fmts, strict=True)), p.bias, p.gemm_rows)
            for p in projs
        ]
        caches = [a.attn.k_cache, a.attn.v_cache]
        described.append(kernel.Layer(
            norms[0].data_ptr(), norms[1].data_ptr(), *linears, caches[0].data_ptr(),
            caches[1].data_ptr(),
        ))  # fmt: skip
        tensors += norms + biases + caches + [b for p in projs for b in p.blocks]
    shape = kernel.decoder_shape(
        hidden=hidden, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, intermediate=inter, eps=first.input_layernorm.eps, dtype=dtype,
        k_cache=attn.k_cache, paired_kv=paired_kv, cos=rotary.cos, sin=rotary.sin,
    )  # fmt: skip
    return _Described((kernel.Layer * len(described))(*described), shape, min(max_rows), tensors)
