"""Host memory that the CPU kernels stream through, on 2 MiB pages where Linux allows.

A decode step reads every weight and each sequence's KV blocks once, from buffers of hundreds
of MiB: on 4 KiB pages that is a TLB miss (a page walk) every 4 KiB of weights and nearly every
2 KiB KV block, which the pool scatters. Linux backs anonymous memory with huge pages only
where it is asked (its default `transparent_hugepage` setting is `madvise`), so the KV cache and
the quantized weights ask before their first touch. Measured in docs/benchmarks/quantization.md,
*Weights and KV cache on 2 MiB pages*. Where the kernel refuses (THP off), nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

log = logging.getLogger(__name__)
_MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>
HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zeroed tensor whose memory, on a Linux CPU, asked for huge pages before it was
    touched (the whole huge pages inside it; a tensor under two of them is left as it is)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu" and sys.platform == "linux" and t.nbytes >= 2 * HUGE_PAGE:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        length = (t.data_ptr() + t.nbytes - start) // HUGE_PAGE * HUGE_PAGE
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(start, length, _MADV_HUGEPAGE) != 0:
            log.info("4 KiB pages: madvise(MADV_HUGEPAGE) failed, errno %d", ctypes.get_errno())
    return t.zero_()


def gather_on_huge_pages(params: list[torch.nn.Parameter]) -> None:
    """Move the CPU parameters' data into one buffer on huge pages, each at a 64-byte boundary
    (parameters on the same data, as a tied LM head and its embedding are, stay on one copy)."""
    align, size = 64, 0
    offsets: dict[tuple[int, int], int] = {}  # (address, bytes) of the data → offset in the buffer
    params = list({id(p): p for p in params}.values())
    for p in params:
        if p.device.type != "cpu" or not p.is_contiguous():
            raise ValueError("only contiguous CPU parameters can be gathered")
        if (p.data_ptr(), p.nbytes) not in offsets:
            offsets[p.data_ptr(), p.nbytes] = size
            size += -(-p.nbytes // align) * align
    buffer = zeros_on_huge_pages((size,), torch.uint8, torch.device("cpu"))
    moved: dict[tuple[int, int], torch.Tensor] = {}
    for p in params:
        key = (p.data_ptr(), p.nbytes)
        if key not in moved:
            view = buffer[offsets[key] : offsets[key] + p.nbytes].view(p.dtype).view(p.shape)
            moved[key] = view.copy_(p.data)
        p.data = moved[key]
