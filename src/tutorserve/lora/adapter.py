"""A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) checked against
the base model and laid out per layer and projection, with the alpha scaling folded into B."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tutorserve.models.classes import model_class
from tutorserve.models.config import ModelConfig

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# Options that change what LoRA computes, refused unless left at PEFT's default.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None}


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    path: Path
    rank: int  # the largest rank of any of its projections
    fingerprint: bytes  # of the weights and config: keys its KV in the prefix cache and tiers
    # (layer, PEFT projection name) → (A [r, in], B [out, r] already scaled by alpha / r)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(name: str, path: str | Path, base: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and validate an adapter; ValueError says what is wrong with it."""
    folder = Path(path).expanduser()
    cfg_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise ValueError(f"LoRA adapter {name!r}: {p} not found")
    try:
        cfg = json.loads(cfg_path.read_text())
        tensors = load_file(weights_path)
    except (json.JSONDecodeError, SafetensorError, OSError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {folder}: {e}") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, default in _UNSUPPORTED.items():
        if cfg.get(key, default) not in (default, [], {}):
            raise ValueError(f"LoRA adapter {name!r}: {key}={cfg[key]!r} is not supported")
    shapes = model_class(base.arch).arch.projection_shapes(base)  # the targets it may have
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    parents: dict[str, str] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in shapes:
            raise ValueError(
                f"LoRA adapter {name!r}: unsupported weight {key!r}; supported targets: "
                f"{', '.join(shapes)}"
            )
        layer = int(m.group(1))
        if layer >= base.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} but the base has "
                             f"{base.num_layers}")  # fmt: skip
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = tensor
        parents[m.group(3)] = m.group(2)
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in {weights_path}")
    weights, rank = {}, 0
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {proj} lacks lora_A or lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        fan_in, fan_out = shapes[proj]
        r = a.shape[0]
        if a.shape != (r, fan_in) or b.shape != (fan_out, r):
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; the base needs A (r, {fan_in}) and B ({fan_out}, r)"
            )
        if not 0 < r <= max_rank:
            raise ValueError(
                f"LoRA adapter {name!r}: rank {r} outside 1..{max_rank} (raise --max-lora-rank)"
            )
        module = f"model.layers.{layer}.{parents[proj]}.{proj}"
        alpha = _pattern(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights[layer, proj] = (a, b * scale)
        rank = max(rank, r)
    digest = hashlib.blake2b(weights_path.read_bytes(), digest_size=16)
    digest.update(json.dumps(cfg, sort_keys=True).encode())
    return LoRAAdapter(name, folder, rank, digest.digest(), weights)


def _pattern(patterns: dict | None, module: str, default: float) -> float:
    """PEFT's per-module override: the first key that matches the module name's tail."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return float(value)
    return float(default)
