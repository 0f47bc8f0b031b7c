"""The KV cache and quantized weights on 2 MiB pages (host_memory.py)."""

import sys
from pathlib import Path

import pytest
import torch

from tutorserve import LLM
from tutorserve.host_memory import HUGE_PAGE, gather_on_huge_pages, zeros_on_huge_pages
from tutorserve.quant import quantized_blocks

CPU = torch.device("cpu")


def _thp_eligible(address: int) -> bool:
    """Whether /proc/self/smaps lets the mapping holding `address` have huge pages (a kernel
    too old to say so skips the test)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    pytest.skip("/proc/self/smaps does not say which mappings may have huge pages")


def _needs_thp() -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform != "linux" or not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this host has no transparent huge pages to ask for")


def test_a_kv_cache_asks_for_huge_pages():
    _needs_thp()
    shape = (2, 3, 1024, 16, 64)  # 12 MiB in bf16
    cache = zeros_on_huge_pages(shape, torch.bfloat16, CPU)
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and not cache.any()
    # Under THP's default `madvise` mode only an advised mapping may get huge pages.
    assert _thp_eligible(cache.data_ptr() + cache.nbytes // 2)
    small = zeros_on_huge_pages((1024,), torch.float32, CPU)
    assert small.shape == (1024,) and not small.any()  # under two huge pages: left as it is


def test_gathered_parameters_keep_their_values_and_sharing():
    _needs_thp()
    sizes = [(3000, 1577), (5,), (1024, 1024), (3,)]  # odd byte counts: 64-byte boundaries
    params = [torch.nn.Parameter(torch.randint(0, 255, s, dtype=torch.uint8), False) for s in sizes]
    params.append(torch.nn.Parameter(torch.randn(700, 33), requires_grad=False))
    tied = torch.nn.Parameter(params[0].data, requires_grad=False)  # a tied head's view
    prefix = torch.nn.Parameter(params[2].data[:7], requires_grad=False)  # same start, fewer bytes
    before = [p.clone() for p in [*params, prefix]]
    gather_on_huge_pages([*params, tied, params[1], prefix])
    assert all(torch.equal(p, b) for p, b in zip([*params, prefix], before, strict=True))
    assert tied.data_ptr() == params[0].data_ptr()
    storages = {p.untyped_storage().data_ptr() for p in [*params, tied, prefix]}
    assert len(storages) == 1 and all(p.data_ptr() % 64 == 0 for p in params)
    assert params[0].nbytes > 2 * HUGE_PAGE  # so its middle lies in an advised huge page
    assert _thp_eligible(params[0].data_ptr() + params[0].nbytes // 2)


def test_an_engine_keeps_its_blocks_in_one_buffer_and_its_kv_on_huge_pages(synth_llama):
    """The target's KV cache and a draft model's (its own pool) alike."""
    llm = LLM(synth_llama, dtype="float32", quantization="int4", speculative=f"draft:{synth_llama}")
    engine = llm.engine
    model = engine.model
    blocks = quantized_blocks(model)
    assert len(blocks) > 1
    assert len({p.untyped_storage().data_ptr() for p in blocks}) == 1
    _needs_thp()
    caches = [engine.runner.k_cache, engine.runner.v_cache]
    caches += [engine.proposer.k_cache, engine.proposer.v_cache]
    for cache in caches:
        assert cache.nbytes > 2 * HUGE_PAGE
        assert _thp_eligible(cache.data_ptr() + cache.nbytes // 2)
