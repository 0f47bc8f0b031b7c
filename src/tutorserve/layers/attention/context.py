"""The per-step context: what the model runner knows about a step, set before the model runs
and read by the layers that need it (attention, LoRA).

Keeping it out of the model's call signature lets `model(input_ids, positions)` stay the same
shape as a plain transformer while attention reads paged-KV details from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tutorserve.layers.attention.backend import AttentionBackend
from tutorserve.layers.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class StepContext:
    slot_mapping: torch.Tensor  # [num_tokens] KV slot of every token computed this step
    backend: AttentionBackend  # runs this step's attention, over `attention`
    attention: AttentionMetadata  # what `backend.build` made for this step
    # The step's LoRA batch (`layers.lora.LoRABatch`), None when no token uses an adapter; the
    # LoRA layer reads it (this module names no layer, so every layer may import it).
    lora: Any = None
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


def current_context() -> StepContext | None:
    """The step's context, or None outside a model runner step."""
    return _CONTEXT


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None
