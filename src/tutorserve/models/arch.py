"""What a model class declares about its architecture, once.

The weight loader, the LoRA layers, the GGUF reader and the synthetic-checkpoint writer read
this declaration (`ModelClass.arch`) instead of knowing model names: which Hugging Face
`model_type`s the class serves, which HF projections it packs into one matmul (and so which a
LoRA adapter may target, and at what shapes), and its attention's extras.
"""

from __future__ import annotations

from dataclasses import dataclass

from tutorserve.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Projection:
    """One HF projection (the name PEFT targets too), where our model keeps it."""

    name: str  # HF / PEFT name, e.g. "k_proj"
    parent: str  # the layer's submodule holding it: "self_attn" or "mlp"
    module: str  # our (possibly fused) linear in that submodule, e.g. "qkv_proj"
    shard: int  # its slice of the fused output, in order


# The Llama-family decoder: q/k/v fused into one matmul, gate/up into another.
DECODER_PROJECTIONS = (
    Projection("q_proj", "self_attn", "qkv_proj", 0),
    Projection("k_proj", "self_attn", "qkv_proj", 1),
    Projection("v_proj", "self_attn", "qkv_proj", 2),
    Projection("o_proj", "self_attn", "o_proj", 0),
    Projection("gate_proj", "mlp", "gate_up_proj", 0),
    Projection("up_proj", "mlp", "gate_up_proj", 1),
    Projection("down_proj", "mlp", "down_proj", 0),
)


@dataclass(frozen=True, slots=True)
class Architecture:
    model_types: tuple[str, ...]  # HF `model_type`s served; the first names synthetic configs
    qkv_bias: bool = False  # q/k/v carry biases (else only if the config's attention_bias says)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3)
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted q/k rows for its RoPE
    projections: tuple[Projection, ...] = DECODER_PROJECTIONS

    def projection_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """(in, out) features of each HF projection."""
        h, inter = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        }  # fmt: skip
        return {p.name: shapes[p.name] for p in self.projections}

    def packed(self, cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
        """Each of our linears ("self_attn.qkv_proj") → its HF projections in shard order,
        with their output sizes."""
        shapes = self.projection_shapes(cfg)
        out: dict[str, list[tuple[str, int]]] = {}
        for p in sorted(self.projections, key=lambda p: p.shard):
            out.setdefault(f"{p.parent}.{p.module}", []).append((p.name, shapes[p.name][1]))
        return out

    def attention_bias(self, cfg: ModelConfig) -> bool:
        return self.qkv_bias or cfg.attention_bias
