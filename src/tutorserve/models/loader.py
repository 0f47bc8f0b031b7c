"""Build a model and tokenizer from a registered name, a HF directory or a GGUF file."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from tutorserve.kernels import quant as quant_kernels
from tutorserve.models.arch import Architecture
from tutorserve.models.classes import model_class
from tutorserve.models.config import ModelConfig
from tutorserve.models.gguf_file import GGUFModel
from tutorserve.models.llama import LlamaForCausalLM
from tutorserve.models.registry import resolve
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.models.weights import install_quantized, load_weights
from tutorserve.quant import QuantWeight
from tutorserve.quant.awq_gptq import packed_linears, scheme_of

log = logging.getLogger(__name__)


# --quantization of a HF checkpoint → the block format its linears are quantized to at load:
# int8 in blocks of 32 with one scale (finer than per-channel), int4 in blocks of 32 with a
# scale and a minimum (group-wise, asymmetric).
AT_LOAD = {"int8": "Q8_0", "int4": "Q4_1"}


def load_model(
    model: str, dtype: torch.dtype, device: torch.device, quantization: str = "none"
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """`quantization`: auto keeps a GGUF's or an AWQ/GPTQ checkpoint's quantized weights as
    they are (CPU only), none dequantizes them, int8/int4 quantize a HF checkpoint's linears
    at load."""
    path = resolve(model)
    gguf = path.suffix == ".gguf"
    if gguf:
        gg = GGUFModel(path)
        config, tokenizer, packed = gg.config, gg.tokenizer(), None
    else:
        config, tensors, tokenizer = _hf_dir(path)
        packed = scheme_of(json.loads((path / "config.json").read_text()), path)
    prequantized = gguf or packed is not None
    if prequantized and quantization in AT_LOAD:
        source = f"{packed.method.upper()} checkpoint" if packed else "GGUF file"
        raise ValueError(
            f"this {source} keeps its own quantization: use auto or none, not {quantization}"
        )
    quantize = quantization in AT_LOAD or (prequantized and quantization == "auto")
    if quantize and not (device.type == "cpu" and quant_kernels.available()):
        # GPUs, and CPUs without our kernels, compute on dequantized weights (same outputs);
        # only an explicit int8/int4 is worth a warning, auto (the default) means "where it can".
        log.log(
            logging.INFO if quantization == "auto" else logging.WARNING,
            "quantized weights need our CPU kernels: %s on %s runs dequantized",
            model,
            device,
        )
        quantize = False
    cls = model_class(config.arch)
    if gguf:
        tensors = gg.tensors(keep_quantized=quantize)
    elif packed:
        tensors = packed_linears(tensors, packed, keep=quantize)
    elif quantize:
        tensors = _quantized_linears(tensors, cls.arch, AT_LOAD[quantization])
    net = cls(config)
    quantized = load_weights(net, tensors)
    net = net.to(device=device, dtype=dtype).eval()
    install_quantized(net, quantized, dtype)
    if quantized:
        _give_back_freed_memory()
    formats = sorted({w.fmt for shards in quantized.values() for w in shards.values()})
    log.info(
        "loaded %s (%s, %d layers) as %s on %s%s",
        model,
        config.arch,
        config.num_layers,
        dtype,
        device,
        f", weights kept in {'/'.join(formats)}" if formats else "",
    )
    return net, tokenizer


def _give_back_freed_memory() -> None:
    """The model was built with float weights that quantized layers have replaced; glibc keeps
    their freed pages unless asked (docs/benchmarks/quantization.md, *Memory*)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _quantized_linears(
    tensors: Iterator[tuple[str, torch.Tensor]], arch: Architecture, fmt: str
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """The projections' weights quantized to `fmt`; one whose inputs are not whole blocks (of
    32) stays float, as llama.cpp's quantizer leaves it."""
    linears = tuple(f".{p.parent}.{p.name}.weight" for p in arch.projections)
    group = quant_kernels.FORMATS[fmt][1]
    for name, t in tensors:
        whole = t.ndim == 2 and t.shape[1] % group == 0
        yield name, QuantWeight.quantize(t, fmt) if whole and name.endswith(linears) else t


def _hf_dir(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], Tokenizer]:
    """A HF folder's architecture, tensors (read lazily) and tokenizer."""
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
                t = sf.get_tensor(name)  # AWQ/GPTQ codes are integers: they stay so
                yield name, t.float() if t.is_floating_point() else t


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
