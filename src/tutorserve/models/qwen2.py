"""Qwen2: the Llama decoder with biases on q, k and v."""

from __future__ import annotations

from tutorserve.models.arch import Architecture
from tutorserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    arch = Architecture(("qwen2",), qkv_bias=True)
