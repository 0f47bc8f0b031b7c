"""Copy Hugging Face-named tensors into our fused modules; quantized ones replace their linear
or embedding module with its quantized form instead."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from tutorserve.host_memory import gather_on_huge_pages
from tutorserve.models.arch import Architecture
from tutorserve.models.config import ModelConfig
from tutorserve.quant import QuantEmbedding, QuantLinear, QuantWeight, Scratch, quantized_blocks

Loaded = torch.Tensor | QuantWeight  # a checkpoint tensor, as floats or as quantized blocks

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_TOP = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def load_weights(
    model: nn.Module, tensors: Iterable[tuple[str, Loaded]]
) -> dict[str, dict[int, QuantWeight]]:
    """Load HF-named tensors into `model`; every parameter must be filled exactly once. Which
    HF projections are packed into which of our linears, the model's class declares. Quantized
    weights are returned by module (and shard) instead, for `install_quantized`."""
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    arch: Architecture = model.arch  # type: ignore[assignment]
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = {fused: parts for fused, parts in arch.packed(cfg).items() if len(parts) > 1}
    shard_sizes = {fused: [size for _, size in parts] for fused, parts in packed.items()}
    # HF module → (our fused module, shard index within it)
    fused_of = {
        f"{p.parent}.{p.name}": (f"{p.parent}.{p.module}", p.shard)
        for p in arch.projections
        if f"{p.parent}.{p.module}" in packed
    }
    tied = cfg.tie_word_embeddings
    wanted = {(n, None) for n in params if not (tied and n == "lm_head.weight")}
    for name, fused in ((n, f) for n in params for f in shard_sizes if f"{f}." in n):
        wanted.discard((name, None))
        wanted |= {(name, i) for i in range(len(shard_sizes[fused]))}
    quantized: dict[str, dict[int, tuple[QuantWeight, torch.Tensor]]] = {}
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        target, fused, shard = _map_name(name, fused_of)
        if target not in params:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        dest = params[target].data
        if fused is not None:
            sizes = shard_sizes[fused]
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        if isinstance(tensor, QuantWeight):
            quantized.setdefault(target.rsplit(".", 1)[0], {})[shard or 0] = (tensor, dest)
        else:
            dest.copy_(tensor)
        wanted.discard((target, shard))
    if wanted:
        missing = sorted(f"{n}" if s is None else f"{n}[{s}]" for n, s in wanted)
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:8])}")
    kept = {}
    for module, shards in quantized.items():
        if len(shards) == len(shard_sizes.get(module.split(".", 2)[-1], [0])):
            kept[module] = {i: w for i, (w, _) in shards.items()}
        else:  # some of a fused linear's parts came as floats: it runs on floats
            for w, dest in shards.values():
                dest.copy_(w.dequantize())
    return kept


def install_quantized(
    model: nn.Module, quantized: dict[str, dict[int, QuantWeight]], dtype: torch.dtype
) -> None:
    """Replace each module `load_weights` returned quantized parts for with its quantized form
    (a tied LM head follows a quantized embedding); `dtype` is the activations'.

    A tied LM head keeps GGUF's layout, sharing the embedding's blocks (which it gathers rows
    of); repacked on its own copy, SmolLM2's gained its step 0-3 % at 1-32 rows
    (bench/head_layout.py). An untied head is repacked like the other layers: Qwen2.5-Coder's
    step on par at batch 1 and 6-7 % faster at 8 (docs/benchmarks/quantization.md, *A bf16 GEMM
    on the blocks*)."""
    scratch = Scratch()
    for name, shards in quantized.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        parts = [shards[i] for i in sorted(shards)]
        if isinstance(old, nn.Embedding):
            new: nn.Module = QuantEmbedding(parts[0], dtype)
        else:
            new = QuantLinear(parts, old.bias, scratch)
        setattr(parent, attr, new)
    embed = getattr(model, "embed_tokens", None)
    if model.config.tie_word_embeddings and isinstance(embed, QuantEmbedding):  # type: ignore[union-attr]
        model.lm_head = QuantLinear([embed.weight()], None, scratch, repack=False)
    # A step streams every block once: in one buffer on 2 MiB pages, not a TLB miss per 4 KiB.
    blocks = quantized_blocks(model)
    if blocks:
        gather_on_huge_pages(blocks)


def _map_name(
    name: str, fused_of: dict[str, tuple[str, int]]
) -> tuple[str, str | None, int | None]:
    if name in _TOP:
        return _TOP[name], None, None
    m = _LAYER.fullmatch(name)
    if not m:
        return name, None, None
    idx, module, kind = m.groups()
    if module in fused_of:
        fused, shard = fused_of[module]
        return f"layers.{idx}.{fused}.{kind}", fused, shard
    return f"layers.{idx}.{module}.{kind}", None, None
