"""Attention that gathers each request's blocks into contiguous tensors first, then runs
PyTorch's attention ops: what GPUs run, and CPUs without our kernels.

Decode rows of very different suffix lengths go in separate buckets, so one long history does
not pad every row; a course prompt's gathered K/V is kept between decode steps while its block
ids and content hashes are unchanged (at most a quarter of the layer's KV cache). Prefill chunks
use SDPA: on the gathered context with a causal mask offset by what was cached, or, for a whole
first chunk, plain causal attention on its fresh K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tutorserve.layers.attention.backend import AttentionBackend, AttentionLayer
from tutorserve.layers.attention.metadata import (
    AttentionBatch,
    AttentionMetadata,
    DecodeBucket,
    SharedPrefixGroups,
    build_decode_batch,
)


@dataclass(slots=True)
class GatherPrefill:
    start: int
    end: int
    context_len: int  # tokens in KV after this step, including this chunk
    # Blocks to gather the context from, and which keys each query may see; both None when
    # the chunk is the whole context so far (plain causal attention on fresh K/V).
    table: torch.Tensor | None = None  # [1, blocks]
    mask: torch.Tensor | None = None  # [q_len, context_len] bool, True = may attend


class GatherBackend(AttentionBackend):
    name = "gather"

    def __str__(self) -> str:
        return "gathers blocks"

    def __init__(self) -> None:
        # Per layer: the shared prefixes' K/V as gathered at the last decode step, with the key
        # naming their blocks and content.
        self._kept: dict[int, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def build(self, batch: AttentionBatch) -> AttentionMetadata[GatherPrefill]:
        dev, prefills = batch.device, []
        for p in batch.prefills:
            if p.first_pos == 0:
                prefills.append(GatherPrefill(p.start, p.end, p.context_len))
                continue
            keys = torch.arange(p.context_len, device=dev)
            mask = keys[None, :] <= torch.arange(p.first_pos, p.context_len, device=dev)[:, None]
            table = torch.as_tensor(p.table, device=dev)[None]
            prefills.append(GatherPrefill(p.start, p.end, p.context_len, table, mask))
        decode = build_decode_batch(batch, in_place=False) if batch.decode_lens else None
        return AttentionMetadata(decode, prefills)

    def kept(self, layer: AttentionLayer) -> torch.Tensor | None:
        """The shared-prefix K this layer keeps between steps, if any."""
        entry = self._kept.get(id(layer))
        return None if entry is None else entry[1]

    def release(self, layer: AttentionLayer) -> None:
        self._kept.pop(id(layer), None)

    def decode_rows(
        self, layer: AttentionLayer, q: torch.Tensor, bucket: DecodeBucket, workspace: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, kvh, dim = q.shape[0], layer.num_kv_heads, layer.head_dim
        k = _gather(workspace, "k", layer.k_cache, bucket.tables, q.dtype)
        v = _gather(workspace, "v", layer.v_cache, bucket.tables, q.dtype)
        qd = q.view(rows, kvh, layer.group, dim).transpose(0, 1)  # [kv_heads, rows, group, dim]
        o, lse = _attend(qd, k, v, bucket.bias, layer.scale)
        o = o.transpose(0, 1).reshape(rows, layer.num_heads, dim)
        return o, lse.transpose(0, 1).reshape(rows, layer.num_heads, 1)

    def shared_prefix(
        self, layer: AttentionLayer, qp: torch.Tensor, sp: SharedPrefixGroups, workspace: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ng, members, kvh, g, dim = qp.shape
        q = qp.permute(2, 0, 1, 3, 4).reshape(kvh, ng, members * g, dim)
        entry = self._kept.get(id(layer))
        if sp.key and entry is not None and entry[0] == sp.key:
            _, kp, vp = entry
        else:
            self.release(layer)  # let the old copies go before making new ones
            kept = bool(sp.key) and _affordable(layer.k_cache, sp.tables)
            ws = None if kept else workspace
            kp = _gather(ws, "kp", layer.k_cache, sp.tables, q.dtype)
            vp = _gather(ws, "vp", layer.v_cache, sp.tables, q.dtype)
            if kept:
                self._kept[id(layer)] = (sp.key, kp, vp)
        op, lsep = _attend_many(q, kp, vp, sp.bias, layer.scale)
        op = op.view(kvh, ng, members, g, dim).permute(1, 2, 0, 3, 4)
        return op, lsep.view(kvh, ng, members, g, 1).permute(1, 2, 0, 3, 4)

    def prefill(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        chunk: GatherPrefill, workspace: dict,
    ) -> torch.Tensor:  # fmt: skip
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        if chunk.table is None:
            ks, vs = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=layer.scale, enable_gqa=True
            )
        else:
            n = chunk.context_len
            ks = _gather(workspace, "k", layer.k_cache, chunk.table, q.dtype)[:, :, :n]
            vs = _gather(workspace, "v", layer.v_cache, chunk.table, q.dtype)[:, :, :n]
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=chunk.mask,
                scale=layer.scale, enable_gqa=True,
            )  # fmt: skip
        return o.squeeze(0).transpose(0, 1)


def _gather(
    workspace: dict | None, name: str, cache: torch.Tensor, tables: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """Blocks of `tables` [rows, blocks] as a contiguous [kv_heads, rows, keys, dim] in
    `dtype` (the queries'), whose two leading dims fold into one batch dim for the attention
    matmuls without a copy. Into the step's workspace buffer `name`, or, without a workspace,
    a tensor of its own."""
    rows, nb = tables.shape
    kvh, _, bs, dim = cache.shape
    numel = kvh * rows * nb * bs * dim
    buf = None if workspace is None else workspace.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != cache.dtype:
        buf = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        if workspace is not None:
            workspace[name] = buf
    out = buf[:numel].view(kvh, rows * nb, bs, dim)
    torch.index_select(cache, 1, tables.reshape(-1), out=out)
    return out.view(kvh, rows, nb * bs, dim).to(dtype)


def _affordable(cache: torch.Tensor, tables: torch.Tensor) -> bool:
    """Whether copies of these prefix blocks' K and V stay within a quarter of the layer's
    KV cache (a prefix of unknown content, or too big, is gathered every step instead)."""
    blocks = cache[:, 0].numel() * tables.numel()
    return 2 * blocks * cache.element_size() <= 2 * cache.nbytes // 4


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of the scores, for merging partial
    results. q: [kvh, B, M, d]; k, v: [kvh, B, L, d]; bias: additive [B, 1, L] (-inf on
    padding) or None when every key is valid → float32 outputs."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if bias is not None:
        scores.add_(bias)
    peak = scores.amax(dim=-1, keepdim=True)
    probs = torch.exp(scores.sub_(peak))
    norm = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs.to(v.dtype), v).float().div_(norm)
    return out, peak + norm.log()


def _attend_many(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_attend` for many queries per key row (a course's students over its shared prompt).
    On CPU, PyTorch's fused flash-attention kernel also returns the log-sum-exp, and beats the
    unfused ops once a key row serves this many queries; elsewhere, the unfused path."""
    if q.device.type != "cpu" or _FLASH_CPU is None:
        return _attend(q, k, v, bias, scale)
    out, lse = _FLASH_CPU(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        0.0,
        False,
        attn_mask=None if bias is None else bias.unsqueeze(1),
        scale=scale,
    )
    return out.transpose(0, 1).float(), lse.transpose(0, 1).unsqueeze(-1)


# PyTorch's CPU flash-attention op, which unlike F.scaled_dot_product_attention returns the LSE.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
