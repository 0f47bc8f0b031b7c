"""Qwen3: the Llama decoder with an RMSNorm over each head of q and of k before RoPE (and no
q/k/v biases, unlike Qwen2)."""

from __future__ import annotations

from tutorserve.models.arch import Architecture
from tutorserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    arch = Architecture(("qwen3",), qk_norm=True)
