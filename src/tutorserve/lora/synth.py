"""Random PEFT-format LoRA adapters for a base model, for tests and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tutorserve.models.classes import model_class
from tutorserve.models.config import ModelConfig

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def synth_lora(
    out: str | Path,
    base: ModelConfig,
    rank: int,
    targets: tuple[str, ...] = DEFAULT_TARGETS,
    alpha: float | None = None,
    seed: int = 0,
    base_name: str = "",
    strength: float = 0.5,
) -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` under `out`. B is random
    (PEFT initializes it to zero, which would make every adapter a no-op), scaled so the adapter
    changes outputs: `strength` is the update's size relative to its input's."""
    if rank < 1:
        raise ValueError("rank must be at least 1")
    arch = model_class(base.arch).arch
    shapes = arch.projection_shapes(base)
    parents = {p.name: p.parent for p in arch.projections}
    unknown = sorted(set(targets) - set(shapes))
    if unknown or not targets:
        raise ValueError(f"unsupported target(s) {unknown}; choose from {', '.join(shapes)}")
    alpha = float(alpha if alpha is not None else 2 * rank)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{parents[proj]}.{proj}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            # The update B·A·x is scaled by alpha / rank on use: undo that, then aim for
            # |B·A·x| ≈ strength · |x|.
            b = torch.randn(fan_out, rank, generator=gen) * strength * rank**0.5 / alpha
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder
