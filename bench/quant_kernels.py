"""The quantized-weight pieces alone, in one process.

    .venv/bin/python bench/quant_kernels.py matmul   # block matmul vs PyTorch, SmolLM2's shapes
    .venv/bin/python bench/quant_kernels.py memory   # weights and resident growth per loading
    .venv/bin/python bench/quant_kernels.py crossover   # repacked rows vs dequantize + GEMM
    .venv/bin/python bench/quant_kernels.py gguf FILE   # a GGUF's own tensors, one per kind
    .venv/bin/python bench/quant_kernels.py crossover FILE   # the same, blocks vs dequantize + GEMM

`matmul`: one `kernels.quant.matmul` call per shape, format and batch against PyTorch's matmul
on the same weight in float32 and bf16 (median of 200 calls; the thread count is PyTorch's).
A format with a repacked layout (`quant.REPACKED`) is also timed repacked.
`crossover`: what `QuantLinear` chooses between at a row count (`quant/layers.py: GEMV_ROWS`):
repacked Q4_1 rows, or dequantizing into the scratch buffer and then bf16 GEMM, beside the GEMM
alone (a model dequantized at load); and the LM head's dequantization alone (median of 30).
`crossover FILE`: the same choice on a GGUF's own tensors (one per projection and format, in
GGUF's layout, and repacked where the format has a repacked layout, with the bf16 GEMM where
the CPU has it on the layout a model keeps) at 8 to 64 rows (median of 20; 5 for the LM head).
`gguf`: the first tensor of each (projection, format) pair in a GGUF file (a Q4_K_M file mixes
several), its real blocks multiplied at batch 1 and 8 (median of 100; 20 for the LM head), in
GGUF's layout and, where the format has one, repacked.
`memory`: SmolLM2 loaded with each `--quantization`/dtype in a fresh process; weights counted
once per storage, and the process's resident growth across the load.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch
from gguf import GGMLQuantizationType, quants

# SmolLM2's gate/up, down and LM head in its formats; Qwen2.5-Coder-0.5B's gate/up in its own.
SHAPES = [
    (3072, 576, ("Q4_1", "Q8_0")),
    (576, 1536, ("Q4_1", "Q8_0")),
    (49152, 576, ("Q4_1", "Q8_0")),
    (9728, 896, ("Q4_0", "Q5_0")),
]


def _median_us(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def matmul() -> None:
    from tutorserve.kernels import isa, quant

    print(f"kernels: {isa.active().level}; threads: {torch.get_num_threads()}")
    print(
        "| shape | format | batch | blocks µs | float32 µs | bf16 µs |\n|---|---|---|---|---|---|"
    )
    for n, k, formats in SHAPES:
        w = torch.randn(n, k) * 0.02
        wb = w.bfloat16()
        for fmt in formats:
            blocks = torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType[fmt]))
            layouts = [(fmt, blocks)]
            if fmt in quant.REPACKED:
                layouts.append((quant.REPACKED[fmt], quant.repack16(blocks, fmt, k)))
            for name, data in layouts:
                for batch in (1, 4, 5, 8, 16):  # 5: a row verifying 4 drafts
                    x = torch.randn(batch, k)
                    xb = x.bfloat16()
                    reps = 50 if n > 10_000 else 200
                    q = _median_us(lambda: quant.matmul(data, name, k, x), reps)  # noqa: B023
                    f = _median_us(lambda: x @ w.T, reps)  # noqa: B023
                    b = _median_us(lambda: xb @ wb.T, reps)  # noqa: B023
                    print(f"| {n}×{k} | {name} | {batch} | {q:.0f} | {f:.0f} | {b:.0f} |")


def crossover() -> None:
    from tutorserve.kernels import isa, quant

    print(f"kernels: {isa.active().level}; threads: {torch.get_num_threads()}; µs")
    print("| shape | rows | repacked Q4_1 | dequantize + bf16 GEMM | bf16 GEMM alone |")
    print("|---|---|---|---|---|")
    for n, k in ((3072, 576), (576, 1536)):
        w = torch.randn(n, k) * 0.02
        blocks = torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType.Q4_1))
        packed, wb = quant.repack16(blocks, "Q4_1", k), w.bfloat16()  # as QuantLinear holds it
        scratch = torch.empty(n, k, dtype=torch.bfloat16)
        for rows in (16, 32, 64, 96, 128, 256):
            x = torch.randn(rows, k).bfloat16()
            y = torch.empty(rows, n, dtype=torch.bfloat16)
            times = [
                _median_us(lambda: quant.matmul(packed, "Q4_1_R16", k, x, y), 30),  # noqa: B023
                _median_us(  # the layer's path above its row limit
                    lambda: (quant.dequantize(packed, "Q4_1_R16", k, out=scratch), x @ scratch.T),  # noqa: B023
                    30,
                ),
                _median_us(lambda: x @ wb.T, 30),  # noqa: B023
            ]
            print(f"| {n}×{k} | {rows} | " + " | ".join(f"{t:,.0f}" for t in times) + " |")
    n, k = 49152, 576  # SmolLM2's tied LM head, Q8_0
    head = torch.from_numpy(
        quants.quantize((torch.randn(n, k) * 0.02).numpy(), GGMLQuantizationType.Q8_0)
    )
    scratch = torch.empty(n, k, dtype=torch.bfloat16)
    t = _median_us(lambda: quant.dequantize(head, "Q8_0", k, out=scratch), 30)
    print(f"LM head {n}×{k} Q8_0 dequantized into bf16: {t / 1000:.1f} ms")


def _kinds(path: str):
    """(projection, format, weight, repacked weight or None) for the first tensor of each
    (projection, format) pair in a GGUF file, the embedding left out (it is gathered)."""
    from gguf import GGUFReader

    from tutorserve.kernels import quant
    from tutorserve.quant.weight import QuantWeight

    seen = set()
    for t in GGUFReader(path).tensors:
        kind = (t.name.split(".")[-2], t.tensor_type.name)
        if t.tensor_type.name not in quant.FORMATS or kind in seen or kind[0] == "token_embd":
            continue
        seen.add(kind)
        blocks = torch.from_numpy(t.data.reshape(int(t.shape[1]), -1).copy())
        weight = QuantWeight(blocks, kind[1], int(t.shape[0]))
        repacked = weight.repacked()
        yield *kind, weight, (repacked if repacked.fmt != weight.fmt else None)


def _head(*columns: str) -> None:
    from tutorserve.kernels import isa

    print(f"kernels: {isa.active().level}; threads: {torch.get_num_threads()}; µs")
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")


def _time_on(w, x: torch.Tensor, reps: int) -> float:
    """Median µs of `w`'s blocks (a QuantWeight) multiplied with x, into bf16."""
    from tutorserve.kernels import quant

    y = torch.empty(x.shape[0], w.out_features, dtype=torch.bfloat16)
    return _median_us(lambda: quant.matmul(w.blocks, w.fmt, w.in_features, x, y), reps)


def gguf_tensors(path: str) -> None:
    _head("tensor", "format", "shape (out × in)", "batch 1", "batch 8", "repacked: batch 1", "8")
    for name, fmt, weight, repacked in _kinds(path):
        n, k = weight.shape
        reps = 20 if n > 10_000 else 100
        times = [
            f"{_time_on(w, torch.randn(batch, k).bfloat16(), reps):,.0f}" if w else "–"
            for w in (weight, repacked)
            for batch in (1, 8)
        ]
        print(f"| {name} | {fmt} | {n}×{k} | " + " | ".join(times) + " |")


def gguf_crossover(path: str) -> None:
    from tutorserve.kernels import quant

    _head("tensor", "format", "rows", "blocks", "repacked", "bf16 GEMM on them",
          "dequantize + bf16 GEMM")  # fmt: skip
    for name, fmt, weight, repacked in _kinds(path):
        n, k = weight.shape
        reps = 5 if n > 10_000 else 20  # the LM head
        scratch = torch.empty(n, k, dtype=torch.bfloat16)
        kept = repacked or weight  # as a model keeps it (an untied LM head too)
        gemm = quant.has_gemm(kept.fmt, n)
        for rows in (8, 12, 16, 24, 32, 64):
            x = torch.randn(rows, k).bfloat16()
            y = torch.empty(rows, n, dtype=torch.bfloat16)

            def dequantized(x=x, y=y, blocks=weight.blocks, fmt=fmt, k=k, scratch=scratch):
                quant.dequantize(blocks, fmt, k, out=scratch)
                torch.mm(x, scratch.T, out=y)

            a, c = _time_on(weight, x, reps), _median_us(dequantized, reps)
            b = f"{_time_on(repacked, x, reps):,.0f}" if repacked else "–"
            g = "–"
            if gemm:
                call = quant.bind_gemm(kept.blocks, kept.fmt, k)
                g = f"{_median_us(lambda x=x, y=y, call=call: call(x, y), reps):,.0f}"
            print(f"| {name} | {fmt} | {rows} | {a:,.0f} | {b} | {g} | {c:,.0f} |")


def _load(quantization: str, dtype: str) -> None:
    import os

    from tutorserve.models.loader import load_model

    def rss() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = rss()
    model, _ = load_model("smollm2-135m-instruct", getattr(torch, dtype), torch.device("cpu"),
                          quantization)  # fmt: skip
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    print(f"| {quantization}, {dtype} | {sum(weights.values()) / 2**20:.1f} MiB "
          f"| {rss() - before:.0f} MiB |")  # fmt: skip


def memory() -> None:
    print("| loading | weights | resident growth |\n|---|---|---|")
    for q, dtype in (("auto", "bfloat16"), ("none", "bfloat16"), ("none", "float32")):
        subprocess.run([sys.executable, __file__, "_load", q, dtype], check=True,
                       stderr=subprocess.DEVNULL)  # fmt: skip


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "matmul":
        matmul()
    elif what == "memory":
        memory()
    elif what == "crossover":
        gguf_crossover(sys.argv[2]) if len(sys.argv) > 2 else crossover()
    elif what == "gguf" and len(sys.argv) > 2:
        gguf_tensors(sys.argv[2])
    elif what == "_load":
        _load(*sys.argv[2:4])
    else:
        sys.exit(__doc__)
