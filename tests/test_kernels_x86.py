"""The x86 levels on CPUs that this host is not, under qemu's emulation of them: the CPU probe
reports what each CPU runs, and the AVX2 level, run on an emulated AMD Zen 3 (AVX2, no AVX-512:
part of our machine pool), matches the scalar level. Tests that force a lower level on an
AVX-512 host (`cpu_isa`) would not notice an AVX-512 instruction leaking into the AVX2 build;
qemu implements no AVX-512, so here such an instruction would stop the harness."""

import platform
import shutil
import subprocess

import numpy as np
import pytest

from tutorserve.kernels.build import COMMON_FLAGS, LEVEL_FLAGS, SOURCES

QEMU = "qemu-x86_64"
HARNESS = "kernel_harness.c"
PROBE = """
#include <stdio.h>
int tutorserve_cpu_levels(void);
int main(void) { printf("%d\\n", tutorserve_cpu_levels()); return 0; }
"""

pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates x86-64 CPUs"),
    pytest.mark.skipif(
        not (shutil.which(QEMU) and shutil.which("cc")),
        reason=f"needs {QEMU} and cc (make test installs them)",
    ),
]


def build(tmp_path, level, main, sources=SOURCES):
    flags = [f for f in COMMON_FLAGS if f not in ("-shared", "-fPIC")] + LEVEL_FLAGS[level]
    exe = tmp_path / f"{level}-{main.stem}"
    subprocess.run(["cc", *flags, "-o", exe, main, *sources, "-lm"], check=True)
    return exe


def emulate(cpu, *command):
    return subprocess.run(
        [QEMU, "-cpu", cpu, *map(str, command)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout


@pytest.mark.parametrize(
    "cpu, levels",
    [("qemu64", 0b00001), ("Haswell", 0b00101), ("EPYC-Milan", 0b00101)],
)
def test_the_cpu_probe_reports_what_the_emulated_cpu_runs(tmp_path, cpu, levels):
    """Bits of `isa.LEVELS`: scalar everywhere, AVX2 on Haswell and Zen 3, nothing wider."""
    main = tmp_path / "probe.c"
    main.write_text(PROBE)
    probe = [source for source in SOURCES if source.name == "isa.c"]
    assert int(emulate(cpu, build(tmp_path, "scalar", main, probe))) == levels


def test_the_avx2_level_runs_on_an_emulated_zen3_and_matches_the_scalar_level(tmp_path, request):
    harness = request.path.with_name(HARNESS)
    outputs = {}
    for level in ("avx2", "scalar"):
        out = tmp_path / f"{level}.bin"
        emulate("EPYC-Milan", build(tmp_path, level, harness), out)
        outputs[level] = np.fromfile(out, dtype=np.float32)
    avx2, scalar = outputs["avx2"], outputs["scalar"]
    assert avx2.size == scalar.size > 20_000
    assert np.isfinite(scalar).all()
    # The harness's last section, the repacked layouts' matmuls: the vector kernels sum each
    # sub-block's products and offsets in another order than the plain-C path (which decodes
    # GGUF blocks), on K-quant rows whose offsets cancel terms ~30x the result; each is within
    # 2e-6 of the largest output of a float64 matmul (tests/test_quant.py), so within 4e-6 here.
    tail = 6 * (3 * 16 + 16 * 512)  # six layouts: 3 x 16 outputs, then 16 x 512 dequantized
    np.testing.assert_allclose(avx2[:-tail], scalar[:-tail], atol=1e-5, rtol=1e-5)
    for part in np.split(scalar.size - tail + np.arange(tail), 6):
        out, rows = part[:48], part[48:]
        np.testing.assert_array_equal(avx2[rows], scalar[rows])
        np.testing.assert_allclose(avx2[out], scalar[out], atol=4e-6 * np.abs(scalar[out]).max())
