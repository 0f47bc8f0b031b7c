"""The model classes by the Hugging Face `model_type` they serve. Adding an architecture is a
file declaring its class (`arch.Architecture`) and one line here."""

from __future__ import annotations

from tutorserve.models.llama import LlamaForCausalLM
from tutorserve.models.qwen2 import Qwen2ForCausalLM
from tutorserve.models.qwen3 import Qwen3ForCausalLM

_CLASSES: tuple[type[LlamaForCausalLM], ...] = (
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
MODEL_CLASSES = {t: cls for cls in _CLASSES for t in cls.arch.model_types}


def model_class(model_type: str) -> type[LlamaForCausalLM]:
    """The class serving `model_type` (ValueError naming the supported ones)."""
    if model_type not in MODEL_CLASSES:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(MODEL_CLASSES)}"
        )
    return MODEL_CLASSES[model_type]
