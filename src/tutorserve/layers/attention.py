"""Paged attention in plain PyTorch.

K/V for every computed token live in a per-layer cache of fixed-size blocks
([num_blocks, block_size, kv_heads, head_dim]); a request's block table lists its blocks in order.
Each step writes the new tokens' K/V at their slots, then:
- decode rows (one query token each) are batched: their contexts are gathered block-wise into a
  padded tensor and one SDPA call covers them all, the query heads of a KV group folded into
  the query-length axis so GQA needs no K/V repetition;
- each prefill chunk attends to its gathered context with a causal mask offset by what was
  already cached, or, when it is the whole context, with plain causal attention on fresh K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tutorserve.engine.context import get_context


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv_heads, dim] → [T, heads * dim]."""
        ctx = get_context()
        n_tok = q.shape[0]
        kv_heads, dim = self.num_kv_heads, self.head_dim
        self.k_cache.view(-1, kv_heads, dim).index_copy_(0, ctx.slot_mapping, k)
        self.v_cache.view(-1, kv_heads, dim).index_copy_(0, ctx.slot_mapping, v)

        nd = ctx.num_decode
        if nd == n_tok and not ctx.prefills:
            return self._decode(q, ctx.decode_block_tables, ctx.decode_mask).view(n_tok, -1)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], ctx.decode_block_tables, ctx.decode_mask)
        for p in ctx.prefills:
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
            if p.block_table is None:
                ks = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
                vs = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                ks = self._gather(self.k_cache, p.block_table, p.context_len)
                vs = self._gather(self.v_cache, p.block_table, p.context_len)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=p.mask, scale=self.scale, enable_gqa=True
                )
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out.view(n_tok, -1)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """One request's context as [1, kv_heads, length, dim]."""
        flat = cache[block_table].view(-1, self.num_kv_heads, self.head_dim)[:length]
        return flat.transpose(0, 1).unsqueeze(0)

    def _decode(
        self, q: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        nd = q.shape[0]
        kv_heads, dim = self.num_kv_heads, self.head_dim
        k = self.k_cache[block_tables].view(nd, -1, kv_heads, dim).transpose(1, 2)
        v = self.v_cache[block_tables].view(nd, -1, kv_heads, dim).transpose(1, 2)
        qg = q.view(nd, kv_heads, self.group, dim)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        return o.reshape(nd, self.num_heads, dim)
