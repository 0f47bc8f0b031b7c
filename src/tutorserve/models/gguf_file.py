"""Read a GGUF file: architecture config, dequantized HF-named tensors, tokenizer, chat template.

llama.cpp stores llama's attn_q/attn_k rows permuted for its interleaved RoPE; we undo that so the
rotate-half RoPE used by Hugging Face (and by us) sees the original layout. Qwen2 needs no change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer
from tqdm import tqdm

from tutorserve.kernels.quant import FORMATS
from tutorserve.models.classes import model_class
from tutorserve.models.config import ModelConfig
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.quant import QuantWeight

log = logging.getLogger(__name__)

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL_TOKEN = 3


class _MissingMetadata(ValueError):
    pass


class GGUFModel:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = gguf.GGUFReader(str(path))
            self._check_tensor_sizes()
            self.arch = self._str("general.architecture")
            fields = self._config_fields()
        except _MissingMetadata:
            raise
        except Exception as e:  # the gguf package raises many types on malformed input
            raise ValueError(f"corrupt or truncated GGUF file {path}: {e}") from e
        self.config = ModelConfig(**fields)

    def _field(self, key: str, default: object = None) -> object:
        field = self.reader.fields.get(key)
        if field is None:
            if default is None:
                raise _MissingMetadata(f"GGUF file {self.path} lacks metadata {key!r}")
            return default
        return field.contents()

    def _str(self, key: str) -> str:
        return str(self._field(key))

    def _num(self, key: str, default: float | None = None) -> float:
        return float(self._field(key, default))  # type: ignore[arg-type]

    def _config_fields(self) -> dict[str, object]:
        a = self.arch
        names = {t.name for t in self.reader.tensors}
        heads = int(self._num(f"{a}.attention.head_count"))
        hidden = int(self._num(f"{a}.embedding_length"))
        vocab = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        return {
            "arch": a,
            "vocab_size": int(self._num(f"{a}.vocab_size", vocab)),
            "hidden_size": hidden,
            "intermediate_size": int(self._num(f"{a}.feed_forward_length")),
            "num_layers": int(self._num(f"{a}.block_count")),
            "num_heads": heads,
            "num_kv_heads": int(self._num(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self._num(f"{a}.rope.dimension_count", hidden // heads)),
            "rope_theta": self._num(f"{a}.rope.freq_base", 10000.0),
            "rms_norm_eps": self._num(f"{a}.attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": int(self._num(f"{a}.context_length")),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": False,  # an architecture with biases declares them
        }

    def _check_tensor_sizes(self) -> None:
        end = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > end or t.data.nbytes != t.n_bytes:
                raise ValueError(f"corrupt or truncated GGUF file {self.path}: tensor {t.name}")

    def tensors(
        self, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        """HF-named tensors; with `keep_quantized`, the weights of formats our kernels take stay
        quantized blocks (`QuantWeight`); norms and other float tensors come as tensors."""
        cfg = self.config
        permuted = model_class(cfg.arch).arch.gguf_permuted_qk
        for t in tqdm(self.reader.tensors, desc=f"loading {self.path.name}", unit="tensor"):
            name = _hf_name(t.name)
            if keep_quantized and t.tensor_type.name in FORMATS and len(t.shape) == 2:
                rows = np.array(t.data)  # a writable copy: the reader's is a view of the mmap
                if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
                    rows = np.ascontiguousarray(_unpermute(rows, heads))
                yield name, QuantWeight(torch.from_numpy(rows), t.tensor_type.name, int(t.shape[0]))
                continue
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
                arr = _unpermute(arr, heads)
            if not (arr.flags.writeable and arr.flags.c_contiguous):
                arr = np.array(arr)  # F32 tensors come back as read-only views of the mmap
            yield name, torch.from_numpy(arr)

    def tokenizer(self) -> Tokenizer:
        f = self.reader.fields
        kind = self._str("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only BPE 'gpt2')")
        tokens = [
            str(bytes(f["tokenizer.ggml.tokens"].parts[i]), "utf-8")
            for i in f["tokenizer.ggml.tokens"].data
        ]
        merges = [
            tuple(str(bytes(f["tokenizer.ggml.merges"].parts[i]), "utf-8").split(" ", 1))
            for i in f["tokenizer.ggml.merges"].data
        ]
        types = [
            int(f["tokenizer.ggml.token_type"].parts[i][0])
            for i in f["tokenizer.ggml.token_type"].data
        ]
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
        fast = FastTokenizer(bpe)
        fast.pre_tokenizer = _pre_tokenizer(str(self._field("tokenizer.ggml.pre", "default")))
        fast.decoder = decoders.ByteLevel()
        fast.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _CONTROL_TOKEN
            ]
        )
        bos = f.get("tokenizer.ggml.bos_token_id")
        eos = int(self._num("tokenizer.ggml.eos_token_id"))
        template = f.get("tokenizer.chat_template")
        return Tokenizer(
            fast,
            bos_token_id=int(bos.contents()) if bos else None,
            eos_token_ids=[eos],
            chat_template=template.contents() if template else None,
            add_bos_token=bool(self._field("tokenizer.ggml.add_bos_token", False)),
        )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "qwen2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in ("default", "gpt2"):
        log.warning("GGUF pre-tokenizer %r unknown; using GPT-2's byte-level rules", pre)
    return byte_level


def _hf_name(name: str) -> str:
    if name in _TENSOR_NAMES:
        return _TENSOR_NAMES[name]
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permute (interleaved pairs → two halves per head)."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
