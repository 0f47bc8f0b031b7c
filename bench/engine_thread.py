"""Batch-1 decode speed by where the engine is built and where it steps, in one process each.

    .venv/bin/python bench/engine_thread.py [MODEL] [--quantization Q]

Three ways, each in a fresh process, one ~590-token prompt decoding 130 tokens, twice (the
second is reported): the engine built and stepped on the main thread; built on the main thread
and stepped on another (what `AsyncEngine` did until it took `make_engine`); built and stepped
on another. Each thread that runs a parallel PyTorch op gets an OpenMP team of its own, and with
more OpenMP threads than cores libgomp stops spinning between parallel regions
(src/tutorserve/engine/async_engine.py).
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import threading
import time

# way → (built on, stepped on)
WAYS = {
    "main": ("main", "main"),
    "loaded-on-main-stepped-on-thread": ("main", "thread"),
    "thread": ("thread", "thread"),
}


def _tpot_ms(model: str, quantization: str, way: str) -> float:
    from tutorserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=130, ignore_eos=True)
    result: list[float] = []

    def decode(engine) -> None:
        for i in range(2):
            engine.add_request(f"r{i}", list(range(1000, 1590)), params)
            times = []
            while engine.has_unfinished():
                if engine.step():
                    times.append(time.perf_counter())
            gaps = [b - a for a, b in itertools.pairwise(times)]
            result.append(1000 * sum(gaps) / len(gaps))

    def load():
        return LLM(model, dtype="bfloat16", quantization=quantization).engine

    if way == "main":
        decode(load())
    elif way == "thread":
        t = threading.Thread(target=lambda: decode(load()))
        t.start()
        t.join()
    else:
        engine = load()
        t = threading.Thread(target=decode, args=(engine,))
        t.start()
        t.join()
    return result[-1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, in this process
    a = p.parse_args()
    if a.way:
        print(f"{_tpot_ms(a.model, a.quantization, a.way):.1f}")
        return
    print("| built on | stepped on | TPOT ms |\n|---|---|---|")
    for way, (built, stepped) in WAYS.items():
        out = subprocess.run(
            [sys.executable, __file__, a.model, "--quantization", a.quantization, "--way", way],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        print(f"| {built} | {stepped} | {out.stdout.split()[-1]} |")


if __name__ == "__main__":
    main()
