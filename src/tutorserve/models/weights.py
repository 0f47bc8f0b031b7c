"""Copy Hugging Face-named tensors into our fused modules."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from tutorserve.models.arch import Architecture
from tutorserve.models.config import ModelConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_TOP = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named tensors into `model`; every parameter must be filled exactly once. Which
    HF projections are packed into which of our linears, the model's class declares."""
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
        dest.copy_(tensor)
        wanted.discard((target, shard))
    if wanted:
        missing = sorted(f"{n}" if s is None else f"{n}[{s}]" for n, s in wanted)
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:8])}")


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
