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
    # For attention that reads blocks in place (then block_table is always set, mask never):
    # [1] int64 context_len, and [1] int64 position of the chunk's first token.
    kv_len: torch.Tensor | None = None
    q_start: torch.Tensor | None = None


@dataclass(slots=True)
class SharedPrefixGroups:
    """Decode rows whose block tables start with the same cached blocks (students of one
    course). Attention over that shared prefix is computed once per group for all its queries,
    then merged with each row's own suffix by log-sum-exp (cascade attention)."""

    tables: torch.Tensor  # [groups, max_prefix_blocks] shared prefix blocks, padded
    bias: torch.Tensor | None  # [groups, 1, max_prefix_blocks * block_size]; None: no padding
    rows: torch.Tensor  # [groups, max_members] decode row of each member, padded with 0
    member_slots: torch.Tensor  # [grouped_rows] flat (group, member) index of each grouped row
    grouped_rows: torch.Tensor  # [grouped_rows] decode row index
    # Each group's prefix blocks and content hash: equal non-empty keys mean equal gathered
    # K/V (shared blocks are full and computed); () means unknown.
    key: tuple = ()
    lens: torch.Tensor | None = None  # [groups] prefix keys, for reading blocks in place


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar suffix length, padded to one width together (one long history
    must not pad every other row to its length). Attention that reads blocks in place takes
    every row in one bucket with its length instead: padding costs it nothing."""

    rows: torch.Tensor | None  # decode row indices; None = all rows, in order
    tables: torch.Tensor  # [rows, max_blocks] blocks after any shared prefix, padded
    bias: torch.Tensor | None  # [rows, 1, max_blocks * block_size] additive; None: no padding
    lens: torch.Tensor | None = None  # [rows] keys in each row's blocks, for in-place reads


@dataclass(slots=True)
class DecodeBatch:
    """The one-token rows, which come first in the flattened batch."""

    buckets: list[DecodeBucket]
    shared: SharedPrefixGroups | None = None


@dataclass(slots=True)
class LoRABatch:
    """Which tokens of the step use an adapter, grouped by the adapter's slot: the rows of one
    slot are contiguous, so each slot's low-rank product is one segment of a grouped matmul."""

    rows: torch.Tensor  # [n] token rows using an adapter, ordered by slot
    offsets: torch.Tensor  # [num_slots] int32 end of each slot's segment in `rows`
    counts: list[int]  # rows per slot
    slots: list[int]  # the slots with rows this step (few: the step's distinct adapters)
    row_slots: torch.Tensor  # [num_tokens] each token's slot; num_slots (a zero slot) if none
    single: int | None  # the slot, when every token of the step uses that one adapter


@dataclass(slots=True)
class StepContext:
    slot_mapping: torch.Tensor  # [num_tokens] KV slot of every token computed this step
    num_decode: int = 0
    decode: DecodeBatch | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    lora: LoRABatch | None = None  # None: no token uses an adapter this step
    # Grow-only scratch tensors reused across layers and steps (gathered K/V), so large
    # gathers do not fault in fresh pages every time.
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)


_CONTEXT: StepContext | None = None


def set_context(ctx: StepContext) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> StepContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a model runner step")
    return _CONTEXT


def lora_batch() -> LoRABatch | None:
    return None if _CONTEXT is None else _CONTEXT.lora


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None
