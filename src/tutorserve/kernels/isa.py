"""Which ISA level of our CPU kernels runs, chosen at run time from what the CPU reports.

Levels, lowest first: `scalar` (plain C, builds everywhere: the reference the others are tested
against), `neon` (AArch64), `avx2` (AVX2 + FMA: 8-wide float32), `avx512` (16-wide) and
`avx512bf16` (adds the bf16 and the int8 (VNNI) dot-product instructions). The best SIMD level
the CPU runs is used, or the one `TUTORSERVE_CPU_ISA` names (to run a lower level on a higher
CPU, e.g. to compare them); if a level's library cannot be built, the next one down runs. The
scalar level runs only when named: on a CPU with no SIMD level PyTorch's own ops run instead,
which beat plain C there (decode at batch 16: 169 ms/step gathering blocks against 226 ms in the
scalar kernel, docs/benchmarks/offline.md). The choice is logged once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from tutorserve.kernels.build import Kernels, load

log = logging.getLogger(__name__)

LEVELS = ("scalar", "neon", "avx2", "avx512", "avx512bf16")  # bit i of tutorserve_cpu_levels
ENV = "TUTORSERVE_CPU_ISA"

_lock = threading.Lock()
_active: list[Kernels | None] = []  # the chosen library, once chosen


def cpu_levels() -> list[str]:
    """The levels this CPU runs, lowest first ([] without a compiler: nothing can be built to
    ask the CPU, and no level would run anyway)."""
    probe = load("scalar")
    if probe is None:
        return []
    bits = probe.lib.tutorserve_cpu_levels()
    return [name for i, name in enumerate(LEVELS) if bits >> i & 1]


def requested() -> str | None:
    """The level `TUTORSERVE_CPU_ISA` asks for (ValueError for an unknown name)."""
    wanted = os.environ.get(ENV, "").strip().lower() or None
    if wanted is not None and wanted not in LEVELS:
        raise ValueError(f"{ENV}={wanted!r}: choose one of {', '.join(LEVELS)}")
    return wanted


def active() -> Kernels | None:
    """The kernels this process runs (chosen at the first call), or None: no compiler, or no
    level could be built."""
    if not _active:
        with _lock:
            if not _active:
                _active.append(_choose())
    return _active[0]


def _choose() -> Kernels | None:
    wanted, levels = requested(), cpu_levels()
    if not levels:
        return None
    if wanted is not None and wanted not in levels:
        log.warning("%s=%s, but this CPU runs only %s: using the best of those", ENV, wanted,
                    ", ".join(levels))  # fmt: skip
        wanted = None
    candidates = levels[: levels.index(wanted) + 1] if wanted else levels[1:]
    for level in reversed(candidates):
        kernels = load(level)
        if kernels is not None:
            log.info("CPU kernels: %s (this CPU runs %s; %s=%s)", level, ", ".join(levels), ENV,
                     os.environ.get(ENV, "unset"))  # fmt: skip
            return kernels
    log.info("CPU kernels: none (this CPU runs %s): PyTorch's ops run instead", ", ".join(levels))
    return None


@contextlib.contextmanager
def use(level: str) -> Iterator[Kernels]:
    """Run `level`'s kernels inside the block (tests and A/B benchmarks compare levels in one
    process). ValueError if this CPU cannot run it or it does not build."""
    levels = cpu_levels()
    if level not in levels:
        raise ValueError(f"this CPU cannot run the {level} kernels (it runs {levels})")
    kernels = load(level)
    if kernels is None:
        raise ValueError(f"the {level} kernels do not build here")
    before = active()
    _active[0] = kernels
    try:
        yield kernels
    finally:
        _active[0] = before
