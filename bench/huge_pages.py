"""What 2 MiB pages (host_memory.py) change for what a decode step streams, in turns in one
process so that the machine's moods hit both sides alike.

    .venv/bin/python bench/huge_pages.py kv 1400 1 random   # context tokens, rows, block order
    .venv/bin/python bench/huge_pages.py weights             # SmolLM2's layers at batch 1

`kv`: decode attention at SmolLM2-135M's shape (30 layers, 3 KV heads of 64, 9 query heads,
bf16, 2,912 blocks of 16: the default 1 GiB pool), one query per row, each layer's cache in
turn so that nothing stays in the CPU's caches between calls; `random`: each row's blocks drawn
anywhere in the pool, as a long-running server's pool ends up, `contiguous`: side by side, as a
fresh pool hands them out. `weights`: 30 layers of SmolLM2's four projections as random Q4_1
rows repacked by sixteen (66 MB), one activation row, each in its own tensor as loaded before
2026-12-06 or all in one buffer on huge pages. Fifteen rounds; prints the median of each side.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType, quants

from tutorserve.host_memory import gather_on_huge_pages, zeros_on_huge_pages
from tutorserve.kernels import isa, quant
from tutorserve.kernels.paged_attention import paged_attention

LAYERS, KV_HEADS, GROUP, DIM, BLOCK, BLOCKS = 30, 3, 3, 64, 16, 2912
CPU = torch.device("cpu")
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def _rounds(sides: dict[str, Callable[[], None]], what: str) -> None:
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(15):
        for name, run in sides.items():
            start = time.perf_counter()
            run()
            ms[name].append(1000 * (time.perf_counter() - start))
    print(
        f"kernels {isa.active().level}, {torch.get_num_threads()} threads; {what}; ms, median "
        "of 15: " + ", ".join(f"{name} {statistics.median(t):.2f}" for name, t in ms.items())
    )


def kv(context: int, rows: int, order: str) -> None:
    shape = (LAYERS, KV_HEADS, BLOCKS, BLOCK, DIM)
    caches = {
        "4 KiB pages": [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)],
        "2 MiB pages": [zeros_on_huge_pages(shape, torch.bfloat16, CPU) for _ in range(2)],
    }
    for k, v in caches.values():
        k.copy_(torch.randn(shape).bfloat16()), v.copy_(torch.randn(shape).bfloat16())
    per_row = -(-context // BLOCK)
    picks = torch.randperm(BLOCKS) if order == "random" else torch.arange(BLOCKS)
    tables = picks[: per_row * rows].reshape(rows, per_row).contiguous()
    lens = torch.full((rows,), context)
    q = torch.randn(rows, KV_HEADS, GROUP, DIM).bfloat16()

    def attend(k: torch.Tensor, v: torch.Tensor) -> None:
        for layer in range(LAYERS):
            paged_attention(q, k[layer], v[layer], tables, lens, DIM**-0.5, group=GROUP)

    sides = {name: (lambda k=k, v=v: attend(k, v)) for name, (k, v) in caches.items()}
    _rounds(sides, f"{LAYERS} layers' attention, {rows} rows of {context} tokens, {order} blocks")


def weights() -> None:
    one = []
    for n, k in PROJECTIONS:
        rows = quants.quantize(torch.randn(n, k).numpy() * 0.02, GGMLQuantizationType.Q4_1)
        one.append((quant.repack16(torch.from_numpy(rows), "Q4_1", k), k))
    apart = [[(w.clone(), k) for w, k in one] for _ in range(LAYERS)]
    together = [[(torch.nn.Parameter(w.clone(), False), k) for w, k in one] for _ in range(LAYERS)]
    gather_on_huge_pages([w for layer in together for w, _ in layer])
    x = {k: torch.randn(1, k) for _, k in PROJECTIONS}

    def project(layers: list[list[tuple[torch.Tensor, int]]]) -> None:
        for layer in layers:
            for w, k in layer:
                quant.matmul(w, "Q4_1_R16", k, x[k])

    size = sum(w.nbytes for w, _ in one) * LAYERS / 1e6
    sides = {
        "4 KiB pages, a tensor each": lambda: project(apart),
        "2 MiB pages, one buffer": lambda: project(together),
    }
    _rounds(sides, f"{LAYERS} layers' Q4_1 projections ({size:.0f} MB), one row")


if __name__ == "__main__":
    if sys.argv[1] == "kv":
        kv(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        weights()
