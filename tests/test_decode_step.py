"""The decoder's layers as one C call on decode steps (`models/decode_step.py`) against the same
model run layer by layer: the same kernels in the same order, so the same logprobs bit for bit,
at every ISA level, on the steps it takes (but for the merge of shared prefixes, which rounds
its own way); the steps it must not take run layer by layer."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tutorserve import LLM, SamplingParams
from tutorserve.kernels import decode_step as kernel
from tutorserve.layers.attention import selector
from tutorserve.lora.synth import synth_lora
from tutorserve.models.loader import load_model_config
from tutorserve.models.synth import SynthSpec, synth_model

# Three prompts of different lengths decode together; logprobs compare whole distributions.
PROMPTS = [list(range(5, 25)), list(range(30, 41)), list(range(100, 190))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def synth(tmp_path_factory, arch: str) -> str:
    # Widths in whole blocks of 32, so every projection quantizes (the shared synthetic
    # models keep a float down_proj, which the C loop does not take).
    spec = SynthSpec(arch=arch, intermediate=192, heads=4, kv_heads=2, seed=5)
    return str(synth_model(tmp_path_factory.mktemp(arch), spec))


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    return synth(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def qwen2_32(tmp_path_factory):
    return synth(tmp_path_factory, "qwen2")  # a bias on q, k and v


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    """Head size 64 and a GQA group of 3, as SmolLM2's."""
    spec = SynthSpec(arch="llama", hidden=192, heads=3, kv_heads=1, intermediate=192, seed=7)
    return str(synth_model(tmp_path_factory.mktemp("llama64"), spec))


@pytest.fixture
def fused_calls(monkeypatch):
    """(rows, groups sharing a prefix, rows computing several tokens) of each step the C loop
    ran."""
    calls: list[tuple[int, int, int]] = []
    run = kernel.decode_layers

    def counting(layers, shape, x, positions, slots, decode, prefixes=None, chunks=None):
        groups = 0 if prefixes is None else prefixes.groups
        calls.append((x.shape[0], groups, 0 if chunks is None else len(chunks)))
        return run(layers, shape, x, positions, slots, decode, prefixes, chunks)

    monkeypatch.setattr(kernel, "decode_layers", counting)
    return calls


def both_ways(
    make: Callable[[], LLM],
    prompts=PROMPTS,
    first: list[list[int]] | None = None,
    params: SamplingParams = GREEDY,
    **kw,
) -> tuple[list, list]:
    """(C loop, layer by layer) outputs of the same requests, each on a fresh engine (so
    that neither finds the other's prompts in its prefix cache), after `first`."""
    outs = []
    for fused in (True, False):
        llm = make()
        if not fused:
            llm.engine.model.fused_decode = None
        if first is not None:
            llm.generate(first, GREEDY)
        outs.append(llm.generate(prompts, params, **kw))
        llm.engine.kv.pool.check_integrity()
    return outs[0], outs[1]


def decode_calls(calls: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The C loop's steps of one-token rows only (a prefill of no more tokens than the blocks
    multiply on takes it too)."""
    return [c for c in calls if not c[2]]


def assert_same(a: list, b: list, tol: float = 0.0) -> None:
    """Same tokens, and logprobs equal (within `tol`)."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for p, q in zip(x.logprobs, y.logprobs, strict=True):
            assert [t for t, _ in p.top] == [t for t, _ in q.top]
            assert all(abs(u - v) <= tol for (_, u), (_, v) in zip(p.top, q.top, strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_decode_steps_in_one_call_match_layer_by_layer(
    cpu_isa, llama32, qwen2_32, fused_calls, dtype, quantization
):
    for model in (llama32, qwen2_32):
        fused, layered = both_ways(lambda m=model: LLM(m, dtype=dtype, quantization=quantization))
        assert_same(fused, layered)
        # every decode step: all three rows, as none ends early
        assert decode_calls(fused_calls) == [(3, 0, 0)] * (GREEDY.max_tokens - 1), fused_calls
        # The 121-token prefill too: the rows are repacked (Q4_1, Q8_0: on their blocks up to
        # 256 rows).
        prefill = (sum(map(len, PROMPTS)), 0, len(PROMPTS))
        assert prefill in fused_calls, fused_calls
        fused_calls.clear()


def test_rows_sharing_course_prompts(cpu_isa, llama32, fused_calls):
    """Students of two courses in the prefix cache, and one other: the grouped rows attend to
    their course prompt once per group and merge it with their own suffix in C. The merge's
    exponentials round like C's, not PyTorch's, which moves a float32 logprob by ~1e-6, or
    ~1e-4 where the difference flips an activation's int8 code in a later matmul (seen at
    the avx2 level)."""
    a, b = list(range(3, 60)), list(range(200, 240))  # 3 and 2 full blocks of 16

    def make() -> LLM:
        return LLM(llama32, dtype="float32", quantization="int4")

    prompts = [[*a, 70], [*b, 71], [*a, 80], list(range(300, 330)), [*a, 90], [*b, 91]]
    fused, layered = both_ways(make, prompts, first=[[*a, 60], [*b, 61]])
    assert_same(fused, layered, tol=1e-3)
    steps = GREEDY.max_tokens - 1
    assert decode_calls(fused_calls) == [(2, 0, 0)] * steps + [(6, 2, 0)] * steps, fused_calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_verifying_drafts(cpu_isa, llama32, fused_calls, dtype):
    """Speculative decoding: a row with drafts computes several tokens, causal over its
    context, in the same call as the step's plain decode rows; token for token the layers'
    replies."""

    def make() -> LLM:
        return LLM(llama32, dtype=dtype, quantization="int4", speculative="ngram",
                   num_speculative_tokens=4, speculative_backoff="fixed")  # fmt: skip

    prompts = [[5, 6, 7, 8, 9] * 6, list(range(40, 52)) * 3, [70, 71] * 10]
    # Long enough for the replies to repeat themselves, which the n-gram proposer drafts
    # from; without logprobs (a request that asks for them is not drafted).
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    fused, layered = both_ways(make, prompts, params=params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in layered]
    assert any(spans for _, _, spans in fused_calls), fused_calls


def test_steps_with_adapter_tokens_run_layer_by_layer(llama32, tmp_path, fused_calls):
    """A step with a token on a LoRA adapter stays with the layers; one with an adapter loaded
    but unused takes the C loop."""
    cfg = load_model_config(llama32)
    adapter = str(synth_lora(tmp_path / "a", cfg, 8, ("q_proj", "down_proj"), seed=1,
                             strength=1.5))  # fmt: skip

    def make() -> LLM:
        return LLM(llama32, dtype="float32", quantization="int4", lora_modules={"a": adapter},
                   max_lora_rank=8)  # fmt: skip

    fused, layered = both_ways(make, lora=["a", None, None])
    assert_same(fused, layered)
    assert fused_calls == []  # row 0 is on the adapter every step
    fused, layered = both_ways(make, lora=[None, None, None])
    assert_same(fused, layered)
    assert decode_calls(fused_calls) == [(3, 0, 0)] * (GREEDY.max_tokens - 1)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_paired_kv_cache_decodes_as_rows_do(
    bf16_dot_isa, llama64, fused_calls, monkeypatch, quantization
):
    """A bf16 model of head size 64 keeps its KV cache paired where the bf16 dot product reads
    it: the same logprobs bit for bit as with rows, layer by layer and (int4)
    in the C loop, rows sharing a course prompt included. The prefill of over 256 tokens runs
    layer by layer, the decode steps after it in C: both must pair alike."""
    a = list(range(3, 60))  # 3 full blocks, in the prefix cache after the first request
    prompts = [[*a, 70], list(range(300, 330)), [*a, 90], list(range(100, 400))]
    outs = []
    for paired in (True, False):
        monkeypatch.setattr(selector.kernel, "pairs_kv", lambda *_, p=paired: p)
        llm = LLM(llama64, dtype="bfloat16", quantization=quantization)
        assert llm.engine.runner.backend.paired_kv is paired
        llm.generate([[*a, 60]], GREEDY)
        outs.append(llm.generate(prompts, GREEDY))
        llm.engine.kv.pool.check_integrity()
    assert_same(*outs)
    assert any(groups for _, groups, _ in fused_calls) is (quantization == "int4"), fused_calls
