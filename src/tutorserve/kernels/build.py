"""Builds our C kernels (`*.c` and `*.h` in this package) into one library at first use, loads it.

They are plain C with no PyTorch headers, so the system compiler builds them in about a second;
the library is cached by sources, flags and CPU under ~/.cache/tutorserve/kernels. It links
`libgomp.so.1`, which resolves to the OpenMP runtime PyTorch has already loaded: the kernels'
threads are PyTorch's own, not a second pool competing for the same cores. A missing or failing
compiler, or a cache directory that cannot be written, is a warning: callers then use their
plain PyTorch paths.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The dtypes the kernels take, by the `is_bf16` flag they pass for each.
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-strict-aliasing",
         "-shared", "-fPIC"]  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels' library, or None when it cannot be built or loaded, or this CPU lacks
    AVX-512 (which every kernel needs)."""
    path = _build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("cannot load the CPU kernels (%s); using plain PyTorch instead", e)
        return None
    lib.tutorserve_isa.argtypes, lib.tutorserve_isa.restype = [], ctypes.c_int
    return lib if lib.tutorserve_isa() > 0 else None


def _build() -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: the CPU kernels are off, plain PyTorch runs instead "
                    "(attention gathers paged blocks; slower on CPUs)")  # fmt: skip
        return None
    parts = [p.read_bytes() for p in SOURCES + HEADERS] + [" ".join(FLAGS).encode(), _cpu_id()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "tutorserve"
    out = cache / "kernels" / f"tutorserve-kernels-{key[:16]}.so"
    if out.exists():
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [cc, *FLAGS, "-o", str(tmp), *map(str, SOURCES), "-lm"], capture_output=True, text=True
        )
        if done.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent first uses each build, one file wins
        error = done.stderr[-2000:]
    except OSError as e:  # no compiler after all, or the cache directory is not writable
        done, error = None, str(e)
    if done is None or done.returncode != 0:
        log.warning("building the CPU kernels failed; using plain PyTorch instead:\n%s",
                    error)  # fmt: skip
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return None
    log.info("built the CPU kernels: %s", out)
    return out


def _cpu_id() -> bytes:
    """What -march=native compiles for: a library built on one CPU must not load on another
    that shares this cache directory."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines))).encode()
