"""Build a model and tokenizer from a registered name, a HF directory or a GGUF file."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from tutorserve.models.classes import model_class
from tutorserve.models.config import ModelConfig
from tutorserve.models.gguf_file import GGUFModel
from tutorserve.models.llama import LlamaForCausalLM
from tutorserve.models.registry import resolve
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.models.weights import load_weights

log = logging.getLogger(__name__)


def load_model(
    model: str, dtype: torch.dtype, device: torch.device
) -> tuple[LlamaForCausalLM, Tokenizer]:
    path = resolve(model)
    if path.suffix == ".gguf":
        gg = GGUFModel(path)
        config, tensors, tokenizer = gg.config, gg.tensors(), gg.tokenizer()
    else:
        config, tensors, tokenizer = _hf_dir(path)
    net = model_class(config.arch)(config)
    load_weights(net, tensors)
    net = net.to(device=device, dtype=dtype).eval()
    log.info(
        "loaded %s (%s, %d layers) as %s on %s",
        model,
        config.arch,
        config.num_layers,
        dtype,
        device,
    )
    return net, tokenizer


def _hf_dir(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], Tokenizer]:
    raw = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    eos = raw.get("eos_token_id")
    gen_file = path / "generation_config.json"
    if gen_file.exists():
        eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return config, _safetensors(files), Tokenizer.from_hf_dir(path, eos_ids)


def _safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in tqdm(files, desc="loading safetensors", unit="file", disable=len(files) < 2):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118  (safe_open has no __iter__)
                yield name, sf.get_tensor(name).float()


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer alone, without building the model."""
    path = resolve(model)
    if path.suffix == ".gguf":
        return GGUFModel(path).tokenizer()
    return _hf_dir(path)[2]


def load_model_config(model: str) -> ModelConfig:
    """The architecture alone, without reading the weights."""
    path = resolve(model)
    if path.suffix == ".gguf":
        return GGUFModel(path).config
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
