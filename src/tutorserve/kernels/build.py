"""Builds our C kernels (`*.c` and `*.h` in this package) into one library per ISA level, at
first use, and loads it.

Each level (`isa.LEVELS`) is the same sources compiled with that level's flags: `simd.h` maps
the kernels' vector type onto its instructions. Flags name the level's instructions rather than
`-march=native`, so a library fits every CPU that has them, and one built by an old compiler
that lacks a level's intrinsics only costs that level. They are plain C with no PyTorch headers,
so the system compiler builds a level in about a second; libraries are cached by sources, flags
and compiler under ~/.cache/tutorserve/kernels. They link `libgomp.so.1`, which resolves to the
OpenMP runtime PyTorch has already loaded: the kernels' threads are PyTorch's own, not a second
pool competing for the same cores. A missing or failing compiler, or a cache directory that
cannot be written, is a warning (callers then take the next level down, or plain PyTorch).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The dtypes the kernels take, by the `is_bf16` flag they pass for each.
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
COMMON_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-strict-aliasing", "-shared", "-fPIC"]
_AVX512 = ["-DTS_AVX512", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
           "-mavx512dq"]  # fmt: skip
LEVEL_FLAGS = {
    "scalar": ["-DTS_SCALAR"],
    "neon": ["-DTS_NEON"],  # an AArch64 compiler targets NEON by default
    "avx2": ["-DTS_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "avx512": _AVX512,
    "avx512bf16": [*_AVX512, "-mavx512bf16", "-DTS_BF16DOT", "-mavx512vnni", "-DTS_VNNI"],
}
# Levels with the bf16 dot-product path (attention over a KV_BF16_PAIRED cache: kv_format.h).
BF16_DOT_LEVELS = frozenset(level for level, f in LEVEL_FLAGS.items() if "-DTS_BF16DOT" in f)

_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tutorserve_cpu_levels": [],
    "tutorserve_level": [],
    "paged_attention": [_ptr] * 6 + [_i64] * 8 + [ctypes.c_float, _i32, _i32, _ptr, _ptr, _i32],
    "add_rms_norm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, _i32, _i32],
    "silu_mul": [_ptr, _ptr, _i64, _i64, _i32, _i32],
    "quant_matmul": [_ptr, _i32, _i64, _i64, _ptr, _i32, _i64, _i64, _ptr, _i32, _i64, _i32],
    "quant_gemm": [_ptr, _i32, _i64, _i64, _ptr, _i64, _i64, _ptr, _i32, _i64, _i32],
    "quant_dequantize": [_ptr, _i32, _i64, _ptr, _i64, _ptr, _i32, _i32],
    "quant_repack16": [_ptr, _i32, _i64, _i64, _ptr],
    "apply_token_bitmask": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i32],
    "rotary_embedding": [_ptr] * 3 + [_i64] * 8 + [_ptr, _ptr, _i64, _i32, _i32, _i32],
    "write_kv": [_ptr, _ptr] + [_i64] * 6 + [_ptr, _ptr, _ptr, _i64, _i64, _i32, _i32, _i32],
    "decode_layers": [_ptr, _i64]
    + [_ptr] * 3
    + [_i64, _ptr, _ptr, _i64, _ptr, _i64]
    + [_ptr] * 3
    + [_i64, _i32],
}


_UNTRACED = contextlib.nullcontext()  # reusable: one object, not one per kernel call


def traced(name: str) -> contextlib.AbstractContextManager:
    """A profiler scope named `name` while torch.profiler records, else nothing: entering a
    `record_function` costs ~10 µs, which hundreds of kernel calls a decode step cannot pay."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _UNTRACED


# Below this many elements a kernel runs on the calling thread: a parallel region costs a
# hand-off to the OpenMP team and a wait for its slowest thread, more than a small norm or
# SiLU·up saves by splitting (docs/benchmarks/quantization.md).
PARALLEL_WORK = 1 << 15


def threads_for(work: int) -> int:
    return torch.get_num_threads() if work >= PARALLEL_WORK else 1


@dataclass(frozen=True, slots=True)
class Kernels:
    """One ISA level's library, its functions declared (each returns 0, or -1 for a shape the
    level cannot take)."""

    level: str
    lib: ctypes.CDLL


@functools.cache
def load(level: str) -> Kernels | None:
    """The kernels built for `level`, or None when they cannot be built or loaded. Says nothing
    of whether this CPU can run them: `isa` decides that before calling anything but the
    scalar level's probe."""
    path = _build(level)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("cannot load the %s CPU kernels (%s)", level, e)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, _i32
    return Kernels(level, lib)


def _build(level: str) -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: the CPU kernels are off, plain PyTorch runs instead "
                    "(attention gathers paged blocks; slower on CPUs)")  # fmt: skip
        return None
    flags = [*COMMON_FLAGS, *LEVEL_FLAGS[level]]
    parts = [p.read_bytes() for p in SOURCES + HEADERS] + [" ".join(flags).encode()]
    key = hashlib.sha256(b"\0".join([*parts, _compiler_id(cc)])).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "tutorserve"
    out = cache / "kernels" / f"tutorserve-kernels-{level}-{key[:16]}.so"
    if out.exists():
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [cc, *flags, "-o", str(tmp), *map(str, SOURCES), "-lm"], capture_output=True, text=True
        )
        if done.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent first uses each build, one file wins
        error = done.stderr[-2000:]
    except OSError as e:  # no compiler after all, or the cache directory is not writable
        done, error = None, str(e)
    if done is None or done.returncode != 0:
        log.warning("building the %s CPU kernels failed:\n%s", level, error)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return None
    log.info("built the %s CPU kernels: %s", level, out)
    return out


@functools.cache
def _compiler_id(cc: str) -> bytes:
    """Which compiler builds the library (another version may build it differently)."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc.encode()
