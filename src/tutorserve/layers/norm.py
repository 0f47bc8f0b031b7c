"""RMSNorm, computed in float32 like the reference implementations, optionally fused with the
residual add before it (as vLLM does): the layer hands on the sum as the next residual."""

from __future__ import annotations

import torch
from torch import nn

from tutorserve.kernels import norm_act


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x); with a residual, (RMSNorm(x + residual), x + residual), the sum written
        into `residual` when the CPU kernel runs (one pass over the rows instead of ~8)."""
        fusable = residual is None or residual.is_contiguous()
        if fusable and norm_act.supports(x, x.shape[-1]) and self.weight.dtype == x.dtype:
            out = norm_act.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
