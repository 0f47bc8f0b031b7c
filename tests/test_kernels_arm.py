"""The NEON level, which no x86 CPU runs: built by an AArch64 cross compiler and run under qemu
against the scalar level built the same way (`kernel_harness.c` runs both on one set of inputs:
attention over float32 and bf16 caches, causal sets, the fused norm and SiLU·up, and the
quantized-weight matmul and dequantizer in every GGUF format). On an AArch64
host the NEON level runs natively and the `cpu_isa` tests cover it."""

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tutorserve.kernels.build import COMMON_FLAGS, LEVEL_FLAGS, SOURCES

CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
HARNESS = Path(__file__).with_name("kernel_harness.c")


@pytest.mark.skipif(platform.machine() == "aarch64", reason="NEON runs natively on this host")
@pytest.mark.skipif(
    not (shutil.which(CC) and shutil.which(QEMU)),
    reason=f"needs {CC} and {QEMU} (make test installs them on x86-64)",
)
def test_the_neon_level_matches_the_scalar_level_under_qemu(tmp_path):
    outputs = {}
    for level in ("neon", "scalar"):
        flags = [f for f in COMMON_FLAGS if f not in ("-shared", "-fPIC")] + LEVEL_FLAGS[level]
        exe = tmp_path / level
        subprocess.run([CC, *flags, "-o", exe, HARNESS, *SOURCES, "-lm"], check=True)
        out = tmp_path / f"{level}.bin"
        subprocess.run([QEMU, "-L", "/usr/aarch64-linux-gnu", exe, out], check=True, timeout=300)
        outputs[level] = np.fromfile(out, dtype=np.float32)
    neon, scalar = outputs["neon"], outputs["scalar"]
    assert neon.size == scalar.size > 20_000
    assert np.isfinite(scalar).all()
    np.testing.assert_allclose(neon, scalar, atol=1e-5, rtol=1e-5)
