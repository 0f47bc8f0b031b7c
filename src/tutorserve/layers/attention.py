"""Paged attention in plain PyTorch.

Per layer, K and V for every computed token live in a cache of fixed-size blocks laid out
[kv_heads, num_blocks, block_size, head_dim]: gathering a request's blocks then yields, per KV
head, one contiguous [context, head_dim] matrix ready for a matmul. Each step writes the new
tokens' K/V at their slots, then:
- decode rows (one query token each) are batched; the query heads of a KV group are folded into
  the query axis so GQA needs no K/V repetition. Rows sharing a cached prefix attend to it once
  per group (cascade attention), and each row to its own suffix; the two partial results are
  merged by their log-sum-exp. Shared course prompts are thus read once per step, not once per
  student. On CPUs both parts read the blocks in place with a small C kernel (`kernels/`);
  elsewhere the blocks are gathered first (and a course prompt's gathered K/V is kept between
  steps while it stays the same);
- each prefill chunk attends causally to its context: in place by the kernel on CPUs;
  elsewhere to its gathered context with a causal mask offset by what was already cached, or,
  when it is the whole context, with plain causal attention on fresh K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tutorserve.engine.context import (
    DecodeBatch,
    DecodeBucket,
    PrefillChunk,
    SharedPrefixGroups,
    StepContext,
    get_context,
)
from tutorserve.kernels.paged_attention import paged_attention


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        # Bound by the model runner once the KV budget is known.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # The shared prefixes' K/V as gathered at the last decode step, reused while the groups'
        # prefixes stay the same: a course prompt is gathered once, not at every step (at most
        # a quarter of the layer's KV cache in extra memory).
        self._shared: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv_heads, dim] → [T, heads * dim]."""
        ctx = get_context()
        n_tok = q.shape[0]
        kvh, dim = self.num_kv_heads, self.head_dim
        # The cache may store a narrower dtype than the model computes in (bf16 under float32).
        slots, kv_dtype = ctx.slot_mapping, self.k_cache.dtype
        self.k_cache.view(kvh, -1, dim).index_copy_(1, slots, k.transpose(0, 1).to(kv_dtype))
        self.v_cache.view(kvh, -1, dim).index_copy_(1, slots, v.transpose(0, 1).to(kv_dtype))

        nd = ctx.num_decode
        if nd == n_tok and ctx.decode is not None:
            return self._decode(q, ctx.decode, ctx).view(n_tok, -1)
        out = torch.empty_like(q)
        if nd and ctx.decode is not None:
            out[:nd] = self._decode(q[:nd], ctx.decode, ctx)
        for p in ctx.prefills:
            if p.kv_len is not None:
                out[p.start : p.end] = self._prefill_in_place(q[p.start : p.end], p)
                continue
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
            if p.block_table is None:
                ks = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
                vs = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                table = p.block_table.unsqueeze(0)
                ks = self._gather(ctx, "k", self.k_cache, table, q.dtype)[:, :, : p.context_len]
                vs = self._gather(ctx, "v", self.v_cache, table, q.dtype)[:, :, : p.context_len]
                ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # [1, kv_heads, ctx, dim]
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=p.mask, scale=self.scale, enable_gqa=True
                )
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out.view(n_tok, -1)

    def _prefill_in_place(self, q: torch.Tensor, p: PrefillChunk) -> torch.Tensor:
        """A prefill chunk's tokens [n, heads, dim] over its context, causally, by the kernel
        (query heads of a KV group folded into the query axis)."""
        n, kvh, g, dim = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        qs = q.view(n, kvh, g, dim).transpose(0, 1).reshape(1, kvh, n * g, dim)
        o, _ = paged_attention(
            qs, self.k_cache, self.v_cache, p.block_table[None], p.kv_len, self.scale, p.q_start, g
        )
        return o.view(kvh, n, g, dim).transpose(0, 1).reshape(n, self.num_heads, dim).to(q.dtype)

    def _gather(
        self,
        ctx: StepContext,
        name: str | None,
        cache: torch.Tensor,
        tables: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Blocks of `tables` [rows, blocks] as a contiguous [kv_heads, rows, keys, dim] in
        `dtype` (the queries'), whose two leading dims fold into one batch dim for the attention
        matmuls without a copy. Into the step's workspace buffer `name`, or, for None, a tensor
        of its own."""
        rows, nb = tables.shape
        kvh, _, bs, dim = cache.shape
        numel = kvh * rows * nb * bs * dim
        buf = ctx.workspace.get(name) if name else None
        if buf is None or buf.numel() < numel or buf.dtype != cache.dtype:
            buf = torch.empty(numel, dtype=cache.dtype, device=cache.device)
            if name:
                ctx.workspace[name] = buf
        out = buf[:numel].view(kvh, rows * nb, bs, dim)
        torch.index_select(cache, 1, tables.reshape(-1), out=out)
        return out.view(kvh, rows, nb * bs, dim).to(dtype)

    def _affordable(self, tables: torch.Tensor) -> bool:
        """Whether copies of these prefix blocks' K and V stay within a quarter of the layer's
        KV cache (a prefix of unknown content, or too big, is gathered every step instead)."""
        blocks = self.k_cache[:, 0].numel() * tables.numel()
        return 2 * blocks * self.k_cache.element_size() <= 2 * self.k_cache.nbytes // 4

    def _decode_rows(
        self, q: torch.Tensor, bucket: DecodeBucket, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of decode rows over their own (suffix) blocks, with log-sum-exp."""
        rows = q.shape[0]
        kvh, dim = self.num_kv_heads, self.head_dim
        if bucket.lens is not None:
            qd = q.view(rows, kvh, self.group, dim)
            o, lse = paged_attention(
                qd, self.k_cache, self.v_cache, bucket.tables, bucket.lens, self.scale
            )
            return o.view(rows, self.num_heads, dim), lse.view(rows, self.num_heads, 1)
        k = self._gather(ctx, "k", self.k_cache, bucket.tables, q.dtype)
        v = self._gather(ctx, "v", self.v_cache, bucket.tables, q.dtype)
        qd = q.view(rows, kvh, self.group, dim).transpose(0, 1)  # [kv_heads, rows, group, dim]
        o, lse = _attend(qd, k, v, bucket.bias, self.scale)
        o = o.transpose(0, 1).reshape(rows, self.num_heads, dim)
        return o, lse.transpose(0, 1).reshape(rows, self.num_heads, 1)

    def _shared_prefix_gathered(
        self, qp: torch.Tensor, sp: SharedPrefixGroups, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's queries [groups, members, kv_heads, group, dim] over its gathered
        prefix → outputs and log-sum-exp, [groups, members, kv_heads, group, dim or 1]."""
        ng, members, kvh, g, dim = qp.shape
        qp = qp.permute(2, 0, 1, 3, 4).reshape(kvh, ng, members * g, dim)
        if sp.key and self._shared is not None and self._shared[0] == sp.key:
            _, kp, vp = self._shared
        else:
            self._shared = None  # let the old copies go before making new ones
            kept = bool(sp.key) and self._affordable(sp.tables)
            kp = self._gather(ctx, None if kept else "kp", self.k_cache, sp.tables, qp.dtype)
            vp = self._gather(ctx, None if kept else "vp", self.v_cache, sp.tables, qp.dtype)
            if kept:
                self._shared = (sp.key, kp, vp)
        op, lsep = _attend_many(qp, kp, vp, sp.bias, self.scale)
        op = op.view(kvh, ng, members, g, dim).permute(1, 2, 0, 3, 4)
        return op, lsep.view(kvh, ng, members, g, 1).permute(1, 2, 0, 3, 4)

    def _decode(self, q: torch.Tensor, batch: DecodeBatch, ctx: StepContext) -> torch.Tensor:
        nd = q.shape[0]
        kvh, g, dim = self.num_kv_heads, self.group, self.head_dim
        if len(batch.buckets) == 1:
            o, lse = self._decode_rows(q, batch.buckets[0], ctx)
        else:
            o = torch.empty(nd, self.num_heads, dim, dtype=torch.float32, device=q.device)
            lse = torch.empty(nd, self.num_heads, 1, dtype=torch.float32, device=q.device)
            for bucket in batch.buckets:
                o[bucket.rows], lse[bucket.rows] = self._decode_rows(q[bucket.rows], bucket, ctx)
        sp = batch.shared
        if sp is None:
            self._shared = None
        else:
            ng, members = sp.rows.shape
            qp = q[sp.rows.reshape(-1)].view(ng, members, kvh, g, dim)
            if sp.lens is not None:  # read in place: [groups, kv_heads, members * group, dim]
                qp = qp.transpose(1, 2).reshape(ng, kvh, members * g, dim)
                op, lsep = paged_attention(
                    qp, self.k_cache, self.v_cache, sp.tables, sp.lens, self.scale
                )
                op = op.view(ng, kvh, members, g, dim).transpose(1, 2)
                lsep = lsep.view(ng, kvh, members, g, 1).transpose(1, 2)
            else:
                op, lsep = self._shared_prefix_gathered(qp, sp, ctx)
            op = op.reshape(ng * members, self.num_heads, dim)[sp.member_slots]
            lsep = lsep.reshape(ng * members, self.num_heads, 1)[sp.member_slots]
            rows = sp.grouped_rows
            os_, lses = o[rows], lse[rows]
            total = torch.logaddexp(lses, lsep)
            o[rows] = os_ * torch.exp(lses - total) + op * torch.exp(lsep - total)
        return o.to(q.dtype)


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
