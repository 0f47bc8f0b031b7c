"""Teacher-forced logits of a whole text through one of our models (its own KV cache, a chunk
of tokens a step), for perplexity and logit comparisons: quantized against dequantized weights
(`bench/quant_parity.py`, tests/test_quant.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tutorserve.layers.attention import AttentionBatch, PrefillSpan, StepContext, select_backend
from tutorserve.layers.attention.context import reset_context, set_context

BLOCK = 16


@torch.inference_mode()
def forward_logits(model: nn.Module, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """[len(ids), vocab] float32 logits, computed `chunk` tokens a step (default: all in one
    step; 1 is how decoding computes them); the model's own KV cache is left as it was."""
    cfg, layers = model.config, model.attention_layers()
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    blocks = -(-len(ids) // BLOCK)
    shape = (cfg.num_kv_heads, blocks, BLOCK, cfg.head_dim)
    saved = [(a.k_cache, a.v_cache) for a in layers]
    for a in layers:
        a.k_cache, a.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    backend = select_backend(torch.device("cpu"), dtype, dtype, cfg.head_dim, BLOCK)
    table, step, out = list(range(blocks)), chunk or len(ids), []
    try:
        for start in range(0, len(ids), step):
            end = min(start + step, len(ids))
            span = PrefillSpan(0, end - start, start, table[: -(-end // BLOCK)])
            batch = AttentionBatch(BLOCK, torch.device("cpu"), dtype, [], [], [], [span], False)
            set_context(
                StepContext(
                    slot_mapping=torch.arange(start, end), backend=backend,
                    attention=backend.build(batch), workspace={},
                )
            )  # fmt: skip
            positions = torch.arange(start, end)
            out.append(model.compute_logits(model(torch.tensor(ids[start:end]), positions)))
            reset_context()
        return torch.cat(out)
    finally:
        reset_context()
        for a, (k, v) in zip(layers, saved, strict=True):
            a.k_cache, a.v_cache = k, v


def perplexity(model: nn.Module, ids: list[int], chunk: int | None = None) -> float:
    logits = forward_logits(model, ids, chunk).double()
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
