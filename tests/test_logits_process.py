"""Logit bias, min_tokens, penalties and log-probabilities, against transformers' logits
processors and a direct computation."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tutorserve import LLM, SamplingParams
from tutorserve.engine.logits_process import process_logits, token_logprobs
from tutorserve.engine.sequence import Sequence
from tutorserve.sampling_params import ParamError

VOCAB = 64
EOS = 2


def _seq(prompt, output, **params):
    seq = Sequence("r", list(prompt), SamplingParams(max_tokens=32, **params))
    seq.token_ids.extend(output)
    return seq


def _hf_processors(prompt_len, bias=None, min_tokens=0, repetition=1.0):
    procs = LogitsProcessorList()
    if bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}))
    if min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, min_tokens, EOS))
    if repetition != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition))
    return procs


@pytest.mark.parametrize(
    "params",
    [
        {"logit_bias": {5: 3.5, 9: -100.0, 60: 0.25}},
        {"min_tokens": 4},
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6},
        {"logit_bias": {7: 2.0}, "min_tokens": 5, "repetition_penalty": 1.3},
    ],
)
def test_bias_min_tokens_and_repetition_match_transformers(params):
    g = torch.Generator().manual_seed(0)
    prompt, output = [1, 7, 7, 30, 5], [9, 9, 41]
    logits = torch.randn(1, VOCAB, generator=g) * 3
    seq = _seq(prompt, output, **params)
    ours = process_logits(logits, [seq], [EOS])
    procs = _hf_processors(
        len(prompt),
        params.get("logit_bias"),
        params.get("min_tokens", 0),
        params.get("repetition_penalty", 1.0),
    )
    ref = procs(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(ours, ref)
    assert not torch.equal(ours, logits)  # each case really changes something


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    prompt, output = [3, 4, 4], [4, 8, 8, 8]
    seq = _seq(prompt, output, presence_penalty=0.5, frequency_penalty=-0.25)
    ours = process_logits(logits, [seq], [EOS])
    ref = logits.clone()
    ref[0, 4] -= -0.25 * 1 + 0.5
    ref[0, 8] -= -0.25 * 3 + 0.5
    torch.testing.assert_close(ours, ref)


def test_min_tokens_bans_stop_token_ids_too_and_lifts_after():
    logits = torch.zeros(2, VOCAB)
    short = _seq([1], [5], min_tokens=2, stop_token_ids=[11])
    done = _seq([1], [5, 6], min_tokens=2, stop_token_ids=[11])
    ours = process_logits(logits, [short, done], [EOS])
    assert ours[0, EOS] == ours[0, 11] == float("-inf")
    assert torch.equal(ours[1], logits[1])
    # ignore_eos: the EOS token is an ordinary token, so it is not banned
    free = _seq([1], [], min_tokens=2, ignore_eos=True)
    assert process_logits(logits[:1], [free], [EOS])[0, EOS] == 0


def test_rows_without_processing_are_untouched_and_logits_not_modified():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    seqs = [_seq([1], [2]), _seq([1], [3], logit_bias={4: 1.0}), _seq([1], [2])]
    ours = process_logits(logits, seqs, [EOS])
    assert torch.equal(logits, before)
    assert torch.equal(ours[[0, 2]], logits[[0, 2]])
    assert ours[1, 4] == logits[1, 4] + 1.0


def test_token_logprobs_is_log_softmax():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    seqs = [_seq([1], [], logprobs=3), _seq([1], [])]
    out = token_logprobs(logits, seqs, [17, 5])
    ref = logits[0].log_softmax(-1)
    assert out[1] is None
    assert out[0].token_id == 17
    assert out[0].logprob == pytest.approx(float(ref[17]), abs=1e-6)
    top = ref.topk(3)
    assert [t for t, _ in out[0].top] == top.indices.tolist()
    assert [p for _, p in out[0].top] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_bad_parameters_are_refused():
    for bad in (
        {"logit_bias": {1: 101.0}},
        {"presence_penalty": 2.5},
        {"repetition_penalty": 0.0},
        {"min_tokens": 33},
        {"logprobs": 21},
        {"stop_token_ids": [-1]},
    ):
        with pytest.raises(ValueError):
            SamplingParams(max_tokens=32, **bad)
    with pytest.raises(ParamError) as e:
        SamplingParams(logit_bias={VOCAB: 1.0}).check_vocab(VOCAB)
    assert e.value.param == "logit_bias"


def _reference(hf, prompt, n, procs):
    """Greedy with transformers' processors; each step's processed log-softmax."""
    ids, steps = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[:, -1].float()
            scores = procs(torch.tensor([ids]), logits)
            steps.append(scores[0].log_softmax(-1))
            ids.append(int(scores.argmax()))
    return ids[len(prompt) :], steps


def test_engine_matches_transformers_with_processors_and_logprobs(synth_llama):
    """A batch where one request has bias, min_tokens, a repetition penalty and logprobs and
    another has none: greedy tokens and log-probabilities as transformers computes them."""
    hf = AutoModelForCausalLM.from_pretrained(synth_llama, dtype=torch.float32).eval()
    eos = hf.config.eos_token_id
    prompt, plain_prompt, n = [5, 17, 17, 40, 9, 12], [8, 9, 10], 12
    bias = {17: 2.5, 40: 1.5, 100: -3.0}
    llm = LLM(synth_llama, dtype="float32")
    shaped = SamplingParams(
        temperature=0, max_tokens=n, logit_bias=bias, min_tokens=n, repetition_penalty=1.4,
        logprobs=4,
    )  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    out, other = llm.generate([prompt, plain_prompt], [shaped, plain])
    procs = LogitsProcessorList(
        [
            SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
            MinNewTokensLengthLogitsProcessor(len(prompt), n, eos),
            RepetitionPenaltyLogitsProcessor(1.4),
        ]
    )
    tokens, steps = _reference(hf, prompt, n, procs)
    assert out.token_ids == tokens
    assert len(out.logprobs) == n
    for lp, ref in zip(out.logprobs, steps, strict=True):
        assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == ref.topk(4).indices.tolist()
    plain_tokens, plain_steps = _reference(hf, plain_prompt, n, LogitsProcessorList())
    assert other.token_ids == plain_tokens
    assert [lp.top for lp in other.logprobs] == [[]] * n
    for lp, ref in zip(other.logprobs, plain_steps, strict=True):
        assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-4)


def test_prompt_logprobs_match_transformers_in_chunks_never_from_the_cache(synth_llama):
    hf = AutoModelForCausalLM.from_pretrained(synth_llama, dtype=torch.float32).eval()
    prompt = [(11 * i) % 450 + 3 for i in range(70)]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    llm = LLM(synth_llama, dtype="float32", max_num_batched_tokens=32)  # prefill in 3 chunks
    plain = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate([prompt], plain)[0].prompt_logprobs is None
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    out = llm.generate([prompt], asked)[0]
    assert out.metrics.num_cached_tokens == 0  # the cached prompt was computed again
    assert [e.token_id for e in out.prompt_logprobs] == prompt[1:]
    for i, e in enumerate(out.prompt_logprobs):
        assert e.logprob == pytest.approx(float(ref[i, prompt[i + 1]]), abs=1e-4)
        assert [t for t, _ in e.top] == ref[i].topk(3).indices.tolist()
