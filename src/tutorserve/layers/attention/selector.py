"""Which attention backend a model runs, chosen once when its runner starts."""

from __future__ import annotations

import torch

from tutorserve.kernels import paged_attention as kernel
from tutorserve.layers.attention.backend import AttentionBackend
from tutorserve.layers.attention.cpu_kernel import CPUKernelBackend
from tutorserve.layers.attention.gather import GatherBackend


def select_backend(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
    block_size: int,
) -> AttentionBackend:  # fmt: skip
    """Our CPU kernel where it takes the model's and the cache's dtypes and the head size (its
    cache paired where its bf16 dot-product path reads it); the gather path elsewhere
    (GPUs, CPUs without a compiler)."""
    if all(kernel.supports(device, dt, head_dim) for dt in (dtype, kv_dtype)):
        return CPUKernelBackend(kernel.pairs_kv(dtype, kv_dtype, head_dim, block_size))
    return GatherBackend()
