"""`batch_invariant`: a request's tokens do not depend on what else its steps compute — how
many requests are in flight, where its prompt's chunks end, whether a course prompt is shared,
whether its drafts are verified — on the default model as served (bf16, its Q4_1 blocks)."""

import pytest

from tutorserve import LLM, SamplingParams
from tutorserve.bench.workloads import edu_shared_prefix
from tutorserve.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SPEC = {"speculative": "suffix", "speculative_disable_by_batch_size": 64,
        "speculative_backoff": "fixed"}  # fmt: skip


def test_a_request_gets_the_same_tokens_whatever_shares_its_steps():
    """One request at a time (each prompt one prefill chunk, decode at batch 1) against four in
    flight (512-token chunks beside decode rows; without the option, four students of a course
    share their prompt's attention by cascade) and four in flight verifying suffix drafts.
    Without the option the first reply parts at its 14th token here, and 7 of 16 replies at 16
    in flight (`bench/batch_invariant.py same`)."""
    runs = []
    for options in ({"max_num_seqs": 1}, {"max_num_batched_tokens": 512}, SPEC):
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16", batch_invariant=True, **options)
        requests = [r for r in edu_shared_prefix(llm.tokenizer, seed=1) if r.course == 0][:4]
        outs = llm.generate([r.prompt_token_ids for r in requests], GREEDY)
        assert all(len(o.prompt_token_ids) > 1000 for o in outs)
        assert sum(o.metrics.num_cached_tokens for o in outs) > 0  # the course prompt is shared
        runs.append([o.token_ids for o in outs])
        pool = llm.engine.kv.pool
        pool.check_integrity()
        assert pool.num_free == pool.num_blocks
    spec = llm.engine.stats().spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert runs[1] == runs[0]
    assert runs[2] == runs[0]


def test_batch_invariance_refuses_what_it_cannot_keep(synth_llama):
    with pytest.raises(ValueError, match="quantized blocks"):
        LLM(synth_llama, dtype="bfloat16", quantization="none", batch_invariant=True)
    with pytest.raises(ValueError, match="LoRA"):
        EngineConfig.from_kwargs(batch_invariant=True, enable_lora=True)
