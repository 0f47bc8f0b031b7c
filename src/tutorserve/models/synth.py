"""Random-init Hugging Face-format checkpoints (config, safetensors, tokenizer) for tests and
benchmarks, so nothing needs a model hub."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tutorserve.models.arch import Architecture
from tutorserve.models.classes import MODEL_CLASSES

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = (
    "A tutor asks a question and waits for the student to think. The student explains the idea "
    "in their own words, and the tutor gives a hint when the answer is not yet right. "
    "Solve x^2 - 5x + 6 = 0 by factoring: (x - 2)(x - 3) = 0, so x = 2 or x = 3. "
    "Yesterday I went to the market and bought an apple, a loaf of bread and some cheese. "
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. "
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000; punctuation , . ; : ! ? ( ) [ ] { } ' \" - + * / = "
)


@dataclass(slots=True)
class SynthSpec:
    arch: str = "llama"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 0  # 0 → 8/3 × hidden rounded up to a multiple of 16
    vocab: int = 512
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seed: int = 0
    init_std: float = 0.08


def synth_model(out: str | Path, spec: SynthSpec) -> Path:
    if spec.arch not in MODEL_CLASSES:
        raise ValueError(f"--arch must be one of {', '.join(MODEL_CLASSES)}, got {spec.arch!r}")
    arch = MODEL_CLASSES[spec.arch].arch
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError("hidden must be divisible by heads, and heads by kv-heads")
    if spec.vocab < 256 + len(SPECIAL_TOKENS) + 16:
        raise ValueError("vocab must be at least 275 (byte alphabet, special tokens, merges)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(spec.vocab)
    tok.save(str(out / "tokenizer.json"))
    inter = spec.intermediate or -(-spec.hidden * 8 // 3 // 16) * 16
    eos = tok.token_to_id("<|im_end|>")
    bos = tok.token_to_id("<|im_start|>")
    config = {
        "architectures": [MODEL_CLASSES[spec.arch].__name__],  # our class names are HF's
        "model_type": spec.arch,
        "hidden_size": spec.hidden,
        "intermediate_size": inter,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden // spec.heads,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if not arch.qkv_bias:
        config |= {"attention_bias": False, "mlp_bias": False}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2)
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": spec.max_position_embeddings,
            },
            indent=2,
        )
    )
    weights = _weights(spec, arch, inter)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _train_tokenizer(vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def _weights(spec: SynthSpec, arch: Architecture, inter: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.hidden // spec.heads
    q, kv, h = spec.heads * head_dim, spec.kv_heads * head_dim, spec.hidden

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * spec.init_std

    w = {"model.embed_tokens.weight": torch.randn(spec.vocab, h, generator=g)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(q, h)
        w[p + "self_attn.k_proj.weight"] = rand(kv, h)
        w[p + "self_attn.v_proj.weight"] = rand(kv, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, q)
        if arch.qkv_bias:
            w[p + "self_attn.q_proj.bias"] = rand(q)
            w[p + "self_attn.k_proj.bias"] = rand(kv)
            w[p + "self_attn.v_proj.bias"] = rand(kv)
        if arch.qk_norm:
            w[p + "self_attn.q_norm.weight"] = 1.0 + rand(head_dim)
            w[p + "self_attn.k_norm.weight"] = 1.0 + rand(head_dim)
        w[p + "mlp.gate_proj.weight"] = rand(inter, h)
        w[p + "mlp.up_proj.weight"] = rand(inter, h)
        w[p + "mlp.down_proj.weight"] = rand(h, inter)
        w[p + "input_layernorm.weight"] = 1.0 + rand(h)
        w[p + "post_attention_layernorm.weight"] = 1.0 + rand(h)
    w["model.norm.weight"] = 1.0 + rand(h)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = rand(spec.vocab, h) * 4
    return {k: v.contiguous() for k, v in w.items()}
