"""The Llama decoder, written for a flattened token batch; the architectures built on it (Qwen2,
Qwen3) differ only in what their class declares (`arch.Architecture`).

Inputs are every token computed this step across all requests, shape [T]; paged attention reads
which request each token belongs to from the step context. q/k/v and gate/up projections are fused
into one matmul each: on a CPU, per-op dispatch dominates small models, so fewer, larger ops win.
"""

from __future__ import annotations

import torch
from torch import nn

from tutorserve.host_memory import zeros_on_huge_pages
from tutorserve.layers.activation import silu_and_mul
from tutorserve.layers.attention import PagedAttention
from tutorserve.layers.norm import RMSNorm
from tutorserve.layers.rotary import RotaryEmbedding
from tutorserve.models.arch import Architecture
from tutorserve.models.config import ModelConfig
from tutorserve.models.decode_step import FusedDecode


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: Architecture, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias(cfg)
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split_with_sizes(self.qkv_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(n, self.num_kv_heads, self.head_dim)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: Architecture, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, arch, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried beside the layer's output, so each residual add is
        fused into the norm that follows it: returns (MLP output, residual before it)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    arch = Architecture(("llama",), gguf_permuted_qk=True)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.arch, rotary) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fused_decode: FusedDecode | None = FusedDecode(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for the flattened batch. A decode-sized step that every
        piece of the layers has a CPU kernel for runs them as one C call (`decode_step.py`)."""
        x = self.embed_tokens(input_ids)
        fused = None if self.fused_decode is None else self.fused_decode(x, positions)
        if fused is not None:
            x, residual = fused
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V caches [layers, kv_heads, blocks, block_size, head_dim] (on 2 MiB pages
        where the host allows: attention streams through them), each layer bound to its slice."""
        cfg = self.config
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        k, v = (zeros_on_huge_pages(shape, dtype, device) for _ in range(2))
        for i, attn in enumerate(self.attention_layers()):
            attn.k_cache, attn.v_cache = k[i], v[i]
        return k, v
