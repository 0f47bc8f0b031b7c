"""Structured outputs' token mask applied to logits in place, in one pass (`bitmask.c`)."""

from __future__ import annotations

import torch

from tutorserve.kernels import isa
from tutorserve.kernels.build import threads_for, traced


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> bool:
    """Set logits[rows[i], t] to -inf where bit t of bitmask[i] is clear. False (nothing done)
    where the kernel does not apply: not float32 rows on a CPU, or no kernels built."""
    kernels = isa.active()
    if (
        kernels is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.stride(-1) != 1
        or bitmask.dtype != torch.int32
        or not bitmask.is_contiguous()
    ):
        return False
    rows = rows.to(torch.int64).contiguous()
    with traced("tutorserve::apply_token_bitmask"):
        status = kernels.lib.apply_token_bitmask(
            logits.data_ptr(), logits.stride(0), rows.data_ptr(), len(rows), bitmask.data_ptr(),
            bitmask.shape[1], logits.shape[1], threads_for(len(rows) * logits.shape[1]),
        )  # fmt: skip
    if status != 0:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot cover {logits.shape[1]}")
    return True
