"""This machine's roofline for decoding a model: what no engine can beat here.

One decode step reads every weight once plus each sequence's KV context, and does about
2 × parameters FLOPs per sequence. With memory bandwidth BW and matmul throughput F measured here,
a step of batch B takes at least max(bytes / BW, flops / F), so decode cannot exceed
B / that tokens per second. The weights' bytes are those of the model as loaded (`weight_bytes`:
quantized blocks read 4.5-8.5 bits per weight), or 2 per parameter without a model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tutorserve.models.config import ModelConfig


@dataclass(slots=True)
class Machine:
    bandwidth_gbs: float  # streaming read, all threads
    bf16_gflops: float  # large bf16 matmul, all threads


def measure_machine(repeats: int = 5) -> Machine:
    """Best of `repeats`: a 1 GiB read (sum) and a 2048³ bf16 matmul."""
    x = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    x.sum()  # first touch
    best_read = min(_timed(x.sum) for _ in range(repeats))
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, dtype=torch.bfloat16)
    a @ b
    best_mm = min(_timed(lambda: a @ b) for _ in range(repeats))
    return Machine(x.numel() * 4 / best_read / 1e9, 2 * 2048**3 / best_mm / 1e9)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def num_params(cfg: ModelConfig) -> int:
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return layers * per_layer + embed + h


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step of a loaded model reads: every parameter (float or
    quantized blocks) once, but the input embedding's unless the LM head reads the same
    storage (a lookup of a few rows is not a read of the table)."""
    head = {p.data_ptr() for p in model.lm_head.parameters()}
    lookup = {p.data_ptr() for p in model.embed_tokens.parameters()} - head
    read = {p.data_ptr(): p.nbytes for p in model.parameters() if p.data_ptr() not in lookup}
    return sum(read.values())


def decode_bound(
    cfg: ModelConfig,
    machine: Machine,
    batch: float,
    context: int,
    bytes_per_value: int = 2,
    weights: int | None = None,
) -> float:
    """Upper bound on decode tokens/s at `batch` sequences of `context` tokens each, KV values
    of `bytes_per_value`; `weights`: the bytes a step reads for them (default: bytes_per_value
    per parameter)."""
    params = num_params(cfg)
    if weights is None:
        # The input embedding is a gather, not a full read; the LM head is a full read.
        untied = cfg.vocab_size * cfg.hidden_size * (not cfg.tie_word_embeddings)
        weights = (params - untied) * bytes_per_value
    read = weights + batch * context * cfg.kv_bytes_per_token(bytes_per_value)
    flops = batch * 2 * params
    step = max(read / (machine.bandwidth_gbs * 1e9), flops / (machine.bf16_gflops * 1e9))
    return batch / step
