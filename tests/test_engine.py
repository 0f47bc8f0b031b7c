"""Engine behaviour end to end on a tiny synthetic model (float32, greedy unless stated)."""

import pytest
import torch

from tutorserve import LLM, SamplingParams
from tutorserve.engine.device import cpu_has_native_bf16, resolve_dtype, resolve_kv_dtype
from tutorserve.layers.attention.cpu_kernel import CPUKernelBackend
from tutorserve.layers.attention.gather import GatherBackend

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(synth_llama, mixed_prompts):
    """Each prompt run alone, prefix caching off: the plainest path through the engine."""
    llm = LLM(synth_llama, dtype="float32", enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in mixed_prompts]


def assert_no_leaks(llm):
    pool = llm.engine.kv.pool
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("batched", [True, False])
def test_outputs_identical_across_caching_and_batching(
    synth_llama, mixed_prompts, reference, caching, batched
):
    llm = LLM(synth_llama, dtype="float32", enable_prefix_caching=caching)
    if batched:
        outs = llm.generate(mixed_prompts, GREEDY)
    else:
        outs = [llm.generate([p], GREEDY)[0] for p in mixed_prompts]
    assert [o.token_ids for o in outs] == reference
    hits = sum(o.metrics.num_cached_tokens for o in outs)
    assert (hits > 0) == caching
    assert_no_leaks(llm)


def test_decode_gathering_blocks_matches_the_cpu_kernel(synth_llama, mixed_prompts, reference):
    """On CPUs decode attention reads blocks in place (the C kernel); the gather path is what
    GPUs run, so it is checked here too, batched with shared prefixes."""
    llm = LLM(synth_llama, dtype="float32")
    assert isinstance(llm.engine.runner.backend, CPUKernelBackend)
    llm.engine.runner.backend = GatherBackend()
    outs = llm.generate(mixed_prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_tiny_kv_budget_preempts_and_still_matches(synth_llama, mixed_prompts, reference, caching):
    # 24 blocks × 16 = 384 tokens for 16 requests of up to ~210 tokens each: must preempt.
    llm = LLM(
        synth_llama,
        dtype="float32",
        num_kv_blocks=24,
        max_model_len=384,
        max_num_batched_tokens=64,
        enable_prefix_caching=caching,
    )
    outs = llm.generate(mixed_prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.metrics.num_preemptions for o in outs)
    assert [o.token_ids for o in outs] == reference
    assert_no_leaks(llm)


def test_chunked_prefill_mixes_with_decode(synth_llama, mixed_prompts, reference):
    llm = LLM(synth_llama, dtype="float32", max_num_batched_tokens=32)
    llm.engine.step_log = []
    outs = llm.generate(mixed_prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    log = llm.engine.step_log
    assert all(s.num_tokens <= 32 for s in log)
    # Some step carried decodes and a prefill chunk together.
    assert any(not s.all_decode and s.num_tokens > s.num_seqs > 1 for s in log)


def test_prefix_cache_hits_reported_and_evicted_lru(synth_llama):
    # The pool alone: with a RAM tier the evicted prefix would come back (test_kv_tiers.py).
    llm = LLM(synth_llama, dtype="float32", num_kv_blocks=16, max_model_len=256, kv_ram_bytes=0)
    shared = list(range(10, 74))  # 4 full blocks
    a = llm.generate([[*shared, 5]], GREEDY)[0]
    b = llm.generate([[*shared, 6, 7]], GREEDY)[0]
    assert a.metrics.num_cached_tokens == 0
    assert b.metrics.num_cached_tokens == 64
    # Fill the pool with unrelated prompts: the old prefix is evicted, so no hit.
    for i in range(3):
        llm.generate([list(range(100 + i * 70, 100 + i * 70 + 66))], GREEDY)
    c = llm.generate([[*shared, 8]], GREEDY)[0]
    assert c.metrics.num_cached_tokens == 0
    assert llm.engine.kv.pool.num_evictions > 0
    assert_no_leaks(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(synth_llama, mixed_prompts):
    llm = LLM(synth_llama, dtype="float32")
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    alone = llm.generate([mixed_prompts[3]], p)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16) for _ in range(5)]
    batch = llm.generate(mixed_prompts[:6], [*others[:3], p, *others[3:]])
    assert batch[3].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16)
    assert llm.generate([mixed_prompts[3]], other_seed)[0].token_ids != alone


def test_stop_strings_stop_token_ids_and_max_tokens(synth_llama):
    llm = LLM(synth_llama, dtype="float32")
    prompt = "A tutor asks a question"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    cut = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    stop_id = full.token_ids[7]
    first = full.token_ids.index(stop_id)
    by_id = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),
    )[0]
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == full.token_ids[: first + 1]


def test_eos_stops_unless_ignored(synth_llama):
    llm = LLM(synth_llama, dtype="float32")
    eos = llm.tokenizer.eos_token_id
    prompt = "Solve x"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    # Force an EOS: make the model's 4th greedy token the EOS id by treating it as one.
    llm.tokenizer.eos_token_ids = [full.token_ids[3]]
    try:
        stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30))[0]
        ignored = llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        )[0]
    finally:
        llm.tokenizer.eos_token_ids = [eos]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3]) + 1]
    assert ignored.token_ids == full.token_ids


def test_streaming_pieces_add_up_to_the_text(synth_llama):
    llm = LLM(synth_llama, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop=["zzz"])
    pieces = list(llm.stream("The student explains", params))
    assert len(pieces) > 3
    assert "".join(pieces) == llm.generate("The student explains", params)[0].text
    assert_no_leaks(llm)


def test_metrics_and_context_limit(synth_llama):
    llm = LLM(synth_llama, dtype="float32", max_model_len=64)
    out = llm.generate([list(range(3, 53))], SamplingParams(temperature=0, max_tokens=100))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 64 - 50  # generation stops at the context length
    m = out.metrics
    assert m.ttft is not None and m.ttft > 0 and m.tpot is not None and m.tpot > 0
    assert m.num_prompt_tokens == 50 and m.num_output_tokens == 14


def test_abort_frees_blocks(synth_llama):
    llm = LLM(synth_llama, dtype="float32")
    engine = llm.engine
    engine.add_request("a", list(range(3, 100)), SamplingParams(max_tokens=50))
    engine.add_request("b", list(range(3, 40)), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.kv.num_used_blocks > 0
    out = engine.abort_request("a")
    assert out.finished and out.finish_reason == "abort"
    engine.abort_request("b")
    assert engine.abort_request("b") is None
    assert_no_leaks(llm)


def test_chat_uses_template(synth_llama):
    llm = LLM(synth_llama, dtype="float32")
    rendered = llm.render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    outs = llm.chat(
        [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]],
        SamplingParams(temperature=0, max_tokens=4),
    )
    assert len(outs) == 2 and all(o.token_ids for o in outs)


def test_a_float32_model_can_store_its_kv_cache_in_bf16(synth_llama, mixed_prompts):
    """bf16 storage under float32 math (the default on CPUs without native bf16): twice the
    blocks in the same bytes, and every path reads the same rounded K/V, so outputs agree with
    and without prefix caching, batched or alone."""
    f32 = LLM(synth_llama, dtype="float32", kv_cache_bytes=8 << 20)
    opts = dict(dtype="float32", kv_cache_dtype="bfloat16", kv_cache_bytes=8 << 20)
    alone = LLM(synth_llama, **opts, enable_prefix_caching=False)
    batched = LLM(synth_llama, **opts)
    assert batched.engine.runner.k_cache.dtype == torch.bfloat16
    assert isinstance(batched.engine.runner.backend, CPUKernelBackend)
    assert batched.engine.kv.pool.num_blocks == 2 * f32.engine.kv.pool.num_blocks
    want = [alone.generate([p], GREEDY)[0].token_ids for p in mixed_prompts]
    outs = batched.generate(mixed_prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert_no_leaks(batched)


def test_auto_dtypes_follow_the_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native = cpu_has_native_bf16()
    model = resolve_dtype("auto", cpu)
    assert model == (torch.bfloat16 if native else torch.float32)
    # Without native bf16 the model computes in float32 and its KV is stored in bf16.
    assert resolve_kv_dtype("auto", "auto", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_dtype("auto", "auto", torch.bfloat16, cpu) == torch.bfloat16
    # A dtype asked for is kept for the KV cache too, unless that is asked for separately.
    assert resolve_kv_dtype("auto", "float32", torch.float32, cpu) == torch.float32
    assert resolve_kv_dtype("bfloat16", "float32", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_dtype("auto", "auto", torch.float16, cuda) == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        LLM("unused", kv_cache_dtype="int8")
