"""The paged-attention kernel alone at batch 1, as SmolLM2 calls it in a decode step.

    .venv/bin/python bench/attention_kernel.py [KEYS] [--rows R | --chunk T]   # 1,100 keys

One decode row's 3 KV heads of 3 query heads each, head size 64, bf16 queries and cache of 16-key
blocks; the row's blocks in order (`seq`, a fresh server) or shuffled (`rnd`, a pool that has
been freed and reused), at 1 and 2 threads. `--rows R`: R decode rows of KEYS keys each (on the
same blocks); `--chunk T`: T tokens causal up to KEYS keys (a prefill chunk, or a row verifying
T - 1 drafts). `hot` calls it on one layer's cache again and again
(in cache); `cold` walks 30 layers' caches (~25 MB at 1,100 keys), as a step does. `kv`: the
cache as rows, or paired (`kernels/kv_format.h`, where the level has the bf16 dot product; the
caches hold random values either way). The time is the best of 5 medians of 300
calls, in µs, since the box's noise only ever adds time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tutorserve.kernels import isa
from tutorserve.kernels.paged_attention import paged_attention, pairs_kv

LAYERS, KV_HEADS, GROUP, DIM, BLOCK, BLOCKS = 30, 3, 3, 64, 16, 291


def best_median_us(call, layers: int) -> float:
    medians = []
    for _ in range(5):
        times = []
        for _ in range(10):
            for layer in range(layers):
                start = time.perf_counter()
                call(layer)
                times.append(time.perf_counter() - start)
        medians.append(statistics.median(times) * 1e6)
    return min(medians)


def main(keys: int, rows: int, chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    shape = (KV_HEADS, BLOCKS, BLOCK, DIM)
    k = [torch.randn(shape, generator=g).bfloat16() for _ in range(LAYERS)]
    v = [torch.randn(shape, generator=g).bfloat16() for _ in range(LAYERS)]
    q = torch.randn(rows, KV_HEADS, GROUP * chunk, DIM, generator=g).bfloat16()
    lens, n = torch.tensor([keys] * rows), -(-keys // BLOCK)
    causal = (torch.tensor([keys - chunk]), GROUP) if chunk > 1 else ()
    print(f"kernels: {isa.active().level}; {rows} rows of {chunk} tokens, {keys} keys; µs per call")
    print("| table | kv | threads | hot | cold |\n|---|---|---|---|---|")
    orders = {"seq": torch.arange(BLOCKS), "rnd": torch.randperm(BLOCKS, generator=g)}
    layouts = [False, True] if pairs_kv(torch.bfloat16, torch.bfloat16, DIM, BLOCK) else [False]
    for name, order in orders.items():
        table = order[:n][None].expand(rows, n).contiguous()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for paired in layouts:

                def call(i: int, table: torch.Tensor = table, paired: bool = paired) -> None:
                    paged_attention(q, k[i], v[i], table, lens, DIM**-0.5, *causal,
                                    paired_kv=paired)  # fmt: skip

                hot, cold = (best_median_us(call, layers) for layers in (1, LAYERS))
                kv = "paired" if paired else "rows"
                print(f"| {name} | {kv} | {threads} | {hot:.0f} | {cold:.0f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keys", type=int, nargs="?", default=1100)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--rows", type=int, default=1)
    shape.add_argument("--chunk", type=int, default=1)
    args = parser.parse_args()
    main(args.keys, args.rows, args.chunk)
