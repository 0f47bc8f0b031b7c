"""The package's dependency order, from its own imports: each package may import only the ones
below it (`paging → kernels → quant → layers → models → lora → spec → structured → engine →
cluster → tutor → server → bench → cli`; the top-level `config`, `sampling_params` and
`host_memory` sit below them all), and no modules import each other, directly or round a longer
loop — type-only imports included."""

import ast
from pathlib import Path

import pytest

import tutorserve
from tutorserve.models.classes import MODEL_CLASSES, model_class

ROOT = Path(tutorserve.__file__).parent
ORDER = ["config", "sampling_params", "host_memory", "paging", "kernels", "quant", "layers",
         "models", "lora", "spec", "structured", "engine", "cluster", "tutor", "voice", "server",
         "bench", "sim", "cli"]  # fmt: skip


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ["tutorserve", *path.relative_to(ROOT).with_suffix("").parts]
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the project modules it imports (a `from package import name` that names a
    submodule counts as importing that submodule)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges[mod] |= {t for t in targets if t in mods and t != mod}
    return edges


def _rank(mod: str) -> int | None:
    parts = mod.split(".")
    return ORDER.index(parts[1]) if len(parts) > 1 and parts[1] in ORDER else None


def test_no_package_imports_a_package_above_it():
    edges = _imports(_modules())
    upward = sorted(
        f"{a} -> {b}"
        for a, bs in edges.items()
        for b in bs
        if a != "tutorserve" and None not in (_rank(a), _rank(b)) and _rank(b) > _rank(a)
    )
    assert not upward, "imports against the dependency order:\n" + "\n".join(upward)


def test_no_import_cycles():
    edges = _imports(_modules())
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                cycles.append(sorted([v, *component]))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_checks_see_the_imports():
    """The walk finds real edges (a check that sees nothing would always pass)."""
    edges = _imports(_modules())
    assert "tutorserve.layers.attention.context" in edges["tutorserve.layers.lora"]
    assert "tutorserve.kernels.isa" in edges["tutorserve.kernels.norm_act"]
    assert _rank("tutorserve.server.app") > _rank("tutorserve.tutor.service")


def test_each_architecture_is_one_declared_class_found_by_its_model_type():
    assert set(MODEL_CLASSES) >= {"llama", "qwen2", "qwen3"}
    for model_type, cls in MODEL_CLASSES.items():
        assert model_class(model_type) is cls and model_type in cls.arch.model_types
    assert model_class("qwen2").arch.qkv_bias and model_class("qwen3").arch.qk_norm
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'; supported: llama"):
        model_class("gpt2")
