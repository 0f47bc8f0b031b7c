"""The attention layer of a decoder over the paged KV cache.

Per layer, K and V for every computed token live in a cache of fixed-size blocks laid out
[kv_heads, num_blocks, block_size, head_dim]. Each step the layer hands the new tokens' K/V and
its queries to the step's backend (`backend.py`), which writes the blocks and reads them its own
way (the CPU kernel's may pair them within a block, `kernels/kv_format.h`).
"""

from __future__ import annotations

import torch
from torch import nn

from tutorserve.layers.attention.context import get_context


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
        ctx.backend.write(self, k, v, ctx.slot_mapping)
        out = ctx.backend.forward(self, q, k, v, ctx.attention, ctx.workspace)
        return out.view(q.shape[0], -1)
