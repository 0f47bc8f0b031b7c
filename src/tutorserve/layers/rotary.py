"""Rotary position embedding in the rotate-half (NeoX / Hugging Face) layout."""

from __future__ import annotations

import torch
from torch import nn

from tutorserve.kernels import rotary as kernel


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.head_dim = head_dim
        # Every layer of a step rotates by the same positions: look them up once per step.
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]. On CPUs the kernel rotates them
        in place (each step's q and k are fresh outputs of the QKV projection) and returns them."""
        if kernel.supports(q, k, self.cos):
            kernel.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        if self._step is None or self._step[0] is not positions or self._step[1].dtype != q.dtype:
            cos = self.cos[positions].unsqueeze(1).to(q.dtype)
            sin = self.sin[positions].unsqueeze(1).to(q.dtype)
            self._step = (positions, cos, sin)
        _, cos, sin = self._step
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
