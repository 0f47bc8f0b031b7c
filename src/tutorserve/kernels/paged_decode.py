"""The CPU decode-attention kernel (`paged_decode.c`): built at first use, loaded with ctypes.

PyTorch has no CPU op that attends over blocks scattered through a paged cache, so the plain
torch path copies each decode row's blocks into a contiguous tensor first: its K/V bytes are
read, written and read again. The kernel reads them once, in place.

It is plain C with no PyTorch headers, so the system compiler builds it in about a second; the
library is cached by source, flags and CPU under ~/.cache/tutorserve/kernels. It links
`libgomp.so.1`, which resolves to the OpenMP runtime PyTorch has already loaded: its threads
are PyTorch's own, not a second pool competing for the same cores. Without a working compiler
`available()` is False and attention gathers blocks instead (as it always does on GPUs).
"""

from __future__ import annotations

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

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-strict-aliasing",
         "-shared", "-fPIC"]  # fmt: skip
# The kernel keeps one block of K or V as float32 on the stack of an OpenMP thread.
MAX_BLOCK_FLOATS = 16_384
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supports(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether decode attention on this device and cache layout can run in the kernel."""
    return (
        device.type == "cpu"
        and dtype in _DTYPES
        and block_size * head_dim <= MAX_BLOCK_FLOATS
        and _library() is not None
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [rows, heads, dim]; caches: [kv_heads, blocks, block_size, dim]; tables: [rows, width]
    int64 (each row's blocks, padded); lens: [rows] int64 keys per row → float32 outputs
    [rows, heads, dim] and log-sum-exp [rows, heads, 1]."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU decode-attention kernel is not available")
    rows, heads, dim = q.shape
    kvh, num_blocks, block_size, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and tables.is_contiguous()):
        raise ValueError("paged_decode needs contiguous caches and tables")
    if tables.dtype != torch.int64 or lens.dtype != torch.int64 or k_cache.dtype != v_cache.dtype:
        raise ValueError("paged_decode needs int64 tables and lens and one cache dtype")
    qf = q.float().contiguous()
    lens = lens.contiguous()
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    lse = torch.empty(rows, heads, 1, dtype=torch.float32)
    lib.paged_decode(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), rows, kvh, heads // kvh, dim, num_blocks, block_size, tables.shape[1],
        scale, _DTYPES[k_cache.dtype], out.data_ptr(), lse.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out, lse


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = _build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("cannot load the CPU decode-attention kernel (%s); gathering blocks instead", e)
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_decode.argtypes = [ptr] * 5 + [i64] * 7 + [ctypes.c_float, ctypes.c_int]
    lib.paged_decode.argtypes += [ptr, ptr, ctypes.c_int]
    lib.paged_decode.restype = None
    return lib


def _build() -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: decode attention gathers paged blocks instead of reading "
                    "them in place (slower on CPUs)")  # fmt: skip
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _cpu_id()])).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "tutorserve"
    out = cache / "kernels" / f"paged_decode-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        done = subprocess.run(
            [cc, *FLAGS, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True
        )
    except OSError as e:
        done = subprocess.CompletedProcess([cc], 1, "", str(e))
    if done.returncode != 0:
        log.warning("building the CPU decode-attention kernel failed; gathering blocks instead:"
                    "\n%s", done.stderr[-2000:])  # fmt: skip
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, out)  # atomic: concurrent first uses each build, one file wins
    log.info("built the CPU decode-attention kernel: %s", out)
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
