"""Per-step attention metadata, set by the model runner and read by the attention layers.

Keeping it out of the model's call signature lets `model(input_ids, positions)` stay the same
shape as a plain transformer while attention reads paged-KV details from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillChunk:
    """One request computing several tokens this step (a whole prompt or a chunk of it)."""

    start: int  # offset of its first query token in the flattened batch
    end: int
    context_len: int  # tokens in KV after this step, including this chunk
    # Blocks to gather the full context from; None when the chunk is the whole context so far
    # (no cached prefix, no earlier chunk), which allows plain causal attention on fresh K/V.
    block_table: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [q_len, context_len] bool, True = may attend


@dataclass(slots=True)
class StepContext:
    slot_mapping: torch.Tensor  # [num_tokens] KV slot of every token computed this step
    num_decode: int = 0  # the first num_decode tokens each belong to a different request
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)


_CONTEXT: StepContext | None = None


def set_context(ctx: StepContext) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> StepContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a model runner step")
    return _CONTEXT


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None
