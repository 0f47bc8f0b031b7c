"""Pick the device, the dtype the model computes in, and the dtype its KV cache is stored in.

On CPUs, `auto` follows what we measured (README, *CPU kernels and dtypes*): where the CPU has
native bf16 (AVX512-BF16 or AMX), bf16 matmuls beat float32 ones, so the model computes and
stores KV in bf16. Elsewhere bf16 matmuls are emulated and slower than float32, so the model
computes in float32 but still stores its KV cache in bf16: the CPU kernels widen K/V as they
read them, so a decode step reads half the bytes and the same memory holds twice the tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_kv_dtype(
    name: str, dtype_name: str, dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's dtype: `name`, or for auto the model's `dtype`, except where both were
    left to auto and a CPU computes in float32 (no native bf16): then bf16 storage."""
    if name != "auto":
        return _DTYPES[name]
    if dtype_name == "auto" and device.type == "cpu" and dtype == torch.float32:
        return torch.bfloat16
    return dtype


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 matmuls are emulated and slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
