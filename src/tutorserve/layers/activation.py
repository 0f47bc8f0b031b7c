"""SwiGLU's activation: SiLU(gate) * up on the fused gate_up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tutorserve.kernels import norm_act


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2n] → [..., n], in one pass on CPUs (the kernel), else two PyTorch ops."""
    if gate_up.shape[-1] % 2 == 0 and norm_act.supports(gate_up, gate_up.shape[-1] // 2):
        return norm_act.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
