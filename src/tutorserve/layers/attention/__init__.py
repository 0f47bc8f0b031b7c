"""Paged attention: the layer, the per-step context the model runner sets for it, the metadata
a step's attention needs, and the backends that read the paged KV cache (our CPU kernel in
place, or gathered blocks through PyTorch's ops), one of which the runner picks once."""

from tutorserve.layers.attention.backend import AttentionBackend
from tutorserve.layers.attention.context import StepContext
from tutorserve.layers.attention.layer import PagedAttention
from tutorserve.layers.attention.metadata import AttentionBatch, PrefillSpan
from tutorserve.layers.attention.selector import select_backend

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "PagedAttention",
    "PrefillSpan",
    "StepContext",
    "select_backend",
]
