"""Speculative decoding: the n-gram proposer; greedy output identical to plain decoding with
prefix caching, preemption, both attention backends, LoRA and the context limit; rejected drafts
leave no KV behind (no leaked block, nothing wrong in the prefix cache); and verification keeps
the sampling distribution."""

import gc
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from tutorserve import LLM, SamplingParams
from tutorserve.engine import model_runner
from tutorserve.engine.sampler import sample, verify
from tutorserve.engine.sequence import Sequence
from tutorserve.layers.attention.gather import GatherBackend
from tutorserve.lora.synth import synth_lora
from tutorserve.models.loader import load_model_config
from tutorserve.paging import hash_block
from tutorserve.sampling_params import StructuredOutputs
from tutorserve.spec import NgramProposer, Proposer, SuffixProposer, proposer_named, scope_key
from tutorserve.spec import suffix as suffix_module
from tutorserve.spec.ngram import longest_match

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SPEC = {
    "speculative": "ngram",
    "num_speculative_tokens": 4,
    "speculative_disable_by_batch_size": 64,
    "speculative_backoff": "fixed",
}


def test_ngram_proposer_drafts_what_followed_the_latest_match():
    ngram = NgramProposer(min_n=2, max_n=3)

    def propose(tokens, k):
        return ngram.propose("r", b"", tokens, k)

    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert propose(tokens, 4) == [5, 6, 7, 1]  # the later of two [1, 2, 3]
    assert propose(tokens, 2) == [5, 6]
    assert propose([*tokens[:-1], 8], 4) == []  # [2, 8] never occurred
    assert propose([5, 6, 5, 6], 4) == [5, 6]  # a match near the end drafts what is left
    assert propose(tokens, 0) == []
    with pytest.raises(ValueError, match="speculative must be one of ngram, suffix"):
        proposer_named("medusa")


def test_the_longest_match_is_the_longest_n_grams_latest_earlier_occurrence():
    """Against a search per n over every earlier window (the way it was found before)."""

    def by_windows(tokens: list[int], min_n: int, max_n: int) -> tuple[int, int]:
        for n in range(max_n, min_n - 1, -1):
            starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
            if starts:
                return n, starts[-1] + n
        return 0, 0

    rng = np.random.default_rng(0)
    for trial in range(400):
        tokens = rng.integers(0, 2 + trial % 5, size=int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 6))
        assert longest_match(tokens, min_n, max_n) == by_windows(tokens, min_n, max_n), tokens


def test_suffix_proposer_drafts_one_students_reply_from_anothers():
    suffix = SuffixProposer(min_n=2, max_n=4)
    course, other = b"algebra", b"english"
    prompt_a, reply_a = [7] * 12 + [50, 51], list(range(10, 40))
    suffix.observe("a", course, prompt_a + reply_a[:3], len(prompt_a))  # indexed as it streams
    suffix.observe("a", course, prompt_a + reply_a, len(prompt_a))
    # Another student with the same history: the texts agree over 14 tokens, so 3 are drafted
    # (a quarter), and as the reply goes on and they agree over more, more are.
    assert suffix.propose("b", course, prompt_a, 16) == reply_a[:3]
    assert suffix.propose("b", course, prompt_a + reply_a[:10], 16) == reply_a[10:16]
    assert suffix.propose("b", course, prompt_a + reply_a[:10], 4) == reply_a[10:14]  # k caps it
    assert suffix.propose("b", course, prompt_a + reply_a[:20], 16) == reply_a[20:28]
    # A student whose prompt only ends alike (the chat template's end): one token.
    assert suffix.propose("c", course, [8, 8, 50, 51], 16) == reply_a[:1]
    assert suffix.propose("b", other, prompt_a, 4) == []  # another course: nothing to draft
    # Its own text still drafts when the scope has nothing (prompt lookup), half the n-gram.
    assert suffix.propose("b", other, [1, 2, 3, 1, 2], 4) == [3]
    assert suffix.propose("b", other, [1, 2, 3, 4, 5, 6, 1, 2, 3, 4], 4) == [5, 6]
    assert suffix.propose("a", course, prompt_a, 4) == []  # never its own output


def test_suffix_proposer_stays_within_its_token_budget():
    suffix = SuffixProposer(min_n=2, max_n=3, max_tokens_per_scope=100, max_scopes=2)
    for i in range(50):
        suffix.observe(f"r{i}", b"c", [1, 2, *range(100 + i, 130 + i)], 2)
    scope = suffix._scopes[b"c"]
    assert scope.num_tokens <= 100 and len(scope.texts) <= 4
    # The index holds only the texts kept: its size is bounded with them.
    occurrences = [suffix_module._occurrences(entries) for entries in scope.index.values()]
    indexed = {e >> suffix_module._END_BITS for entries in occurrences for e in entries}
    assert indexed == {text.ident for text in scope.texts.values()} == set(scope.by_ident)
    assert len(scope.index) <= 2 * scope.num_tokens
    # Nothing in the index for the garbage collector to walk, however many tokens it holds.
    assert not any(gc.is_tracked(entries) for entries in scope.index.values())
    for name in (b"d", b"e"):
        suffix.observe("x" + name.decode(), name, [1, 2, 3], 2)
    assert list(suffix._scopes) == [b"d", b"e"]  # the least recently used scope went


def _no_leaks(llm: LLM) -> None:
    pool = llm.engine.kv.pool
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks
    assert not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def plain(synth_llama, mixed_prompts):
    llm = LLM(synth_llama, dtype="float32", enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(mixed_prompts, GREEDY)]


@pytest.mark.parametrize(
    ("method", "caching", "backend", "drafts"),
    [
        ("ngram", True, "cpu-kernel", 4),
        ("ngram", False, "cpu-kernel", 4),
        ("ngram", True, "gather", 4),
        ("suffix", True, "cpu-kernel", None),  # the proposer's own: up to 11 a row
        ("suffix", False, "gather", 4),
    ],
)
def test_greedy_output_is_identical_with_speculation(
    synth_llama, mixed_prompts, plain, method, caching, backend, drafts
):
    llm = LLM(synth_llama, dtype="float32", enable_prefix_caching=caching,
              **{**SPEC, "speculative": method, "num_speculative_tokens": drafts})  # fmt: skip
    assert llm.engine.max_drafts == (drafts or 11)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(synth_llama, speculative=method, num_speculative_tokens=0)  # not "the default"
    if backend == "gather":
        llm.engine.runner.backend = GatherBackend()
    outs = llm.generate(mixed_prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    spec = llm.engine.stats().spec
    # Both kinds of step happened: drafts accepted, and drafts rejected.
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    _no_leaks(llm)


def logits_by_context(monkeypatch) -> dict[tuple[int, ...], torch.Tensor]:
    """Every logit row the engine samples or verifies from, keyed by the tokens before it."""
    seen: dict[tuple[int, ...], torch.Tensor] = {}

    def sampling(logits, seqs, generator):
        for row, seq in zip(logits, seqs, strict=True):
            seen[tuple(seq.token_ids)] = row.clone()
        return sample(logits, seqs, generator)

    def verifying(logits, seq, generator):
        for j, row in enumerate(logits):
            seen[(*seq.token_ids, *seq.spec_token_ids[:j])] = row.clone()
        return verify(logits, seq, generator)

    monkeypatch.setattr(model_runner, "sample", sampling)
    monkeypatch.setattr(model_runner, "verify", verifying)
    return seen


def test_the_default_model_verifies_with_plain_decodings_logits_bit_for_bit(monkeypatch):
    """The default model as served (bf16, on its Q4_1 blocks, the layers in one C call), two
    requests in flight: every logit row of a token verified with drafts after it equals, bit for
    bit, the row plain decoding computes from the same tokens, so greedy replies are the same
    where bf16 sums taken in another order would flip near-ties (they did, in 52 of 76 rows,
    before the kernels gave a row the same bits whatever shares its step: tests/test_quant.py,
    tests/test_attention.py). Prompts past 256 tokens, so attention merges parts."""
    seen = logits_by_context(monkeypatch)
    prompts = [
        "Explain step by step how to solve 3x + 5 = 20, then check the answer. " * 12,
        "Write a short story about a student who learns fractions by baking a cake. " * 18,
    ]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = []
    for spec in ({}, SPEC):
        seen.clear()
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16", max_num_seqs=2, **spec)
        assert llm.engine.model.fused_decode is not None
        outs = llm.generate(prompts, params)
        assert all(len(o.prompt_token_ids) > 256 for o in outs)
        runs.append(([o.token_ids for o in outs], dict(seen)))
        _no_leaks(llm)
    spec = llm.engine.stats().spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    (plain, plain_rows), (tokens, spec_rows) = runs
    common = plain_rows.keys() & spec_rows.keys()
    assert len(common) >= len(prompts) * params.max_tokens
    assert all(torch.equal(plain_rows[c], spec_rows[c]) for c in common)
    assert tokens == plain


def test_a_request_alone_verifies_the_longest_suffix_drafts_with_plain_decodings_logits(
    monkeypatch,
):
    """A second student sending the first's request gets the first's reply drafted as long as
    the proposer drafts (11 tokens, 12 query rows); every row is still the same bits as plain
    decoding's (with 16 drafts the LM head ran a dequantized GEMM above 12 rows, and did not)."""
    seen = logits_by_context(monkeypatch)
    prompt = "Explain step by step how to solve 3x + 5 = 20, then check the answer. " * 4
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = []
    for spec in ({}, {"speculative": "suffix", "speculative_backoff": "fixed"}):
        seen.clear()
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16", max_num_seqs=1, **spec)
        outs = llm.generate([prompt, prompt], params)
        runs.append(([o.token_ids for o in outs], dict(seen)))
        _no_leaks(llm)
    accepted = llm.engine.stats().spec.accepted_per_position
    assert len(accepted) == SuffixProposer.max_drafts and accepted[-1] > 0  # whole drafts kept
    (plain, plain_rows), (tokens, spec_rows) = runs
    common = plain_rows.keys() & spec_rows.keys()
    assert len(common) >= params.max_tokens
    assert all(torch.equal(plain_rows[c], spec_rows[c]) for c in common)
    assert tokens == plain


def test_cached_blocks_hold_no_rejected_draft(synth_llama, mixed_prompts, plain):
    """A second turn (prompt + reply) hits the blocks the first turn wrote while speculating;
    its output must equal a plain engine's, which it would not if a rejected draft's K/V had
    been published."""
    llm = LLM(synth_llama, dtype="float32", **SPEC)
    first = llm.generate(mixed_prompts, GREEDY)
    second_prompts = [p + o.token_ids for p, o in zip(mixed_prompts, first, strict=True)]
    fresh = LLM(synth_llama, dtype="float32", enable_prefix_caching=False)
    want = [o.token_ids for o in fresh.generate(second_prompts, GREEDY)]
    outs = llm.generate(second_prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_cached_tokens for o in outs) > sum(len(p) for p in mixed_prompts)
    _no_leaks(llm)


class _Refused(Proposer):
    """k copies of one token: drafts the model nearly always refuses, so almost every step
    writes K/V for tokens it then throws away."""

    def propose(self, request: str, scope: bytes, tokens: list[int], k: int) -> list[int]:
        return [7] * k


def test_blocks_spilled_to_the_kv_tiers_hold_no_rejected_draft(synth_llama):
    """A turn decoded under refused drafts, its blocks pushed out of the pool into the RAM
    tier, then restored from there for the next turn: that turn equals a plain engine's, which
    it would not if a rejected draft's K/V had been spilled."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 470, 200).tolist()
    llm = LLM(synth_llama, dtype="float32", num_kv_blocks=48, kv_ram_bytes=1 << 26, **SPEC)
    llm.engine.proposer = _Refused()
    reply = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    spec = llm.engine.stats().spec
    assert spec.num_draft_tokens > 4 * spec.num_accepted_tokens  # refused, nearly all
    for _ in range(4):  # unrelated prompts take every block of the pool
        llm.generate([rng.integers(3, 470, 300).tolist()], GREEDY)
    history = prompt + reply[0].token_ids
    assert llm.engine.kv.pool.lookup(hash_block(b"", history[:16])) is None  # left the pool
    fresh = LLM(synth_llama, dtype="float32", enable_prefix_caching=False, kv_ram_bytes=0)
    out = llm.generate([history], GREEDY)[0]
    assert out.token_ids == fresh.generate([history], GREEDY)[0].token_ids
    # Every full block of the history, the reply's among them, came back from the tier.
    assert out.metrics.num_cached_tokens == (len(history) - 1) // 16 * 16 > len(prompt)
    assert {t.name: t.stats for t in llm.engine.store.tiers}["ram"].hits >= 16
    _no_leaks(llm)


def test_speculation_under_preemption(synth_llama, mixed_prompts, plain):
    llm = LLM(
        synth_llama, dtype="float32", num_kv_blocks=24, max_model_len=384,
        max_num_batched_tokens=64, **SPEC,
    )  # fmt: skip
    outs = llm.generate(mixed_prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().spec.num_accepted_tokens > 0
    assert [o.token_ids for o in outs] == plain
    _no_leaks(llm)


def test_speculation_stops_at_the_context_limit_and_at_max_tokens(synth_llama, mixed_prompts):
    prompts = [p for p in mixed_prompts if 40 < len(p) < 130][:4]
    for params in (
        SamplingParams(temperature=0, max_tokens=500, ignore_eos=True),  # runs into max_model_len
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ):
        want = LLM(synth_llama, dtype="float32", max_model_len=160).generate(prompts, params)
        llm = LLM(synth_llama, dtype="float32", max_model_len=160, **SPEC)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in want]
        assert all(len(p) + len(o.token_ids) <= 160 for p, o in zip(prompts, outs, strict=True))
        assert llm.engine.stats().spec.num_drafts > 0
        _no_leaks(llm)


def test_drafts_are_verified_with_the_rows_adapter(synth_llama, mixed_prompts, tmp_path):
    cfg = load_model_config(synth_llama)
    loras = {
        f"l{i}": str(synth_lora(tmp_path / f"l{i}", cfg, 8, seed=i, strength=1.5)) for i in range(2)
    }
    names = [None, "l0", "l1"]

    def run(**kw):
        llm = LLM(synth_llama, dtype="float32", lora_modules=loras, **kw)
        lora = [names[i % 3] for i in range(6)]
        return llm, [o.token_ids for o in llm.generate(mixed_prompts[:6], GREEDY, lora=lora)]

    _, want = run()
    llm, got = run(**SPEC)
    assert got == want
    assert llm.engine.stats().spec.num_accepted_tokens > 0


CHI2_5DF_P001 = 20.515  # chi-square, 5 degrees of freedom (6 tokens), p = 0.001


def _target(logits: torch.Tensor, temperature: float, top_k: int) -> np.ndarray:
    """The sampling distribution, computed here independently of the sampler."""
    z = logits.double() / temperature
    z[z < z.topk(top_k).values[-1]] = float("-inf")
    return torch.softmax(z, dim=-1).numpy()


@pytest.mark.parametrize("draft", [1, 6])  # a likely draft and an unlikely one
def test_verification_keeps_the_sampling_distribution(draft):
    """Rejection sampling with a one-hot draft: over many seeds, the first emitted token is
    distributed as plain sampling draws it, and so is the token after an accepted draft."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, generator=g) * 1.5
    logits[0, 1] += 2.0  # token 1 likely at the first position
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=4)
    n = 20_000
    first, second = np.zeros(8), np.zeros(8)
    for seed in range(n):
        seq = Sequence("r", [0], replace(params, seed=seed))
        seq.spec_token_ids = [draft]
        out = verify(logits, seq, torch.Generator())
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
    assert second.sum() == first[draft]  # a second token exactly when the draft was kept
    for counts, want in ((first, _target(logits[0], 0.8, 6)), (second, _target(logits[1], 0.8, 6))):
        assert counts[want == 0].sum() == 0  # nothing outside the top 6
        expected = counts.sum() * want[want > 0]
        chi2 = ((counts[want > 0] - expected) ** 2 / expected).sum()
        assert chi2 < CHI2_5DF_P001, (counts, expected)


def test_seeded_sampling_gives_the_same_tokens_with_speculation(synth_llama, mixed_prompts):
    """A seeded token's noise follows its position, so speculating, whatever it drafts and
    keeps, gives the tokens plain sampling gives."""
    params = SamplingParams(temperature=0.5, seed=7, max_tokens=30, ignore_eos=True)
    plain = LLM(synth_llama, dtype="float32").generate(mixed_prompts, params)
    llm = LLM(synth_llama, dtype="float32", **SPEC)
    outs = llm.generate(mixed_prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    spec = llm.engine.stats().spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_structured_rows_draft_within_their_grammar(synth_llama, method):
    """A JSON reply drafted from an earlier one (suffix) or from its prompt (ngram, whose drafts
    the grammar mostly refuses: they are cut where it does) gives plain decoding's tokens."""
    schema = {"type": "object", "properties": {"mistake": {"enum": ["sign", "order"]},
              "note": {"type": "string", "maxLength": 12}}, "required": ["mistake", "note"],
              "additionalProperties": False}  # fmt: skip
    params = SamplingParams(
        temperature=0, max_tokens=60, structured=StructuredOutputs(json=json.dumps(schema))
    )
    reference = LLM(synth_llama, dtype="float32")
    # The prompt's JSON breaks the schema: after `"note"`, ngram drafts `":5}` (not a string).
    text = reference.engine.tokenizer.encode('{"mistake":"order","note":5} ')
    prompts = [text, text, [*text, 12]]
    plain = reference.generate(prompts, params)
    llm = LLM(synth_llama, dtype="float32", **{**SPEC, "speculative": method})
    outs = [llm.generate([p], params)[0] for p in prompts]  # one after another: one drafts the next
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(json.loads(o.text)["mistake"] in ("sign", "order") for o in outs)
    spec = llm.engine.stats().spec
    assert spec.num_draft_tokens > 0
    if method == "suffix":
        assert spec.num_accepted_tokens > len(plain[0].token_ids) // 2  # the second reply
    _no_leaks(llm)


def test_scopes_follow_the_name_else_the_prompt_start_and_never_cross_adapters():
    course = list(range(300))
    a, b = [*course, 1, 2], [*course, 3]  # two students of one course
    assert scope_key(a, None) == scope_key(b, None) != scope_key(list(range(1, 301)), None)
    assert scope_key(a, "explain/algebra/p1/1") == scope_key([9], "explain/algebra/p1/1")
    assert scope_key(a, "explain/algebra/p1/1") != scope_key(a, "explain/algebra/p1/2")
    assert scope_key(a, None) != scope_key(a, None, b"adapter")


def test_a_stop_string_inside_accepted_drafts_ends_the_reply_where_plain_decoding_does(
    synth_llama, mixed_prompts
):
    prompts = mixed_prompts[:6]
    plain_llm = LLM(synth_llama, dtype="float32")
    texts = [o.text for o in plain_llm.generate(prompts, GREEDY)]

    def late_stop(text: str) -> str:
        """4 characters whose first occurrence is as late in `text` as possible."""
        at = max(i for i in range(len(text) - 3) if text.find(text[i : i + 4]) == i)
        return text[at : at + 4]

    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[late_stop(t)])
        for t in texts
    ]
    want = [(o.text, o.finish_reason) for o in plain_llm.generate(prompts, params)]
    llm = LLM(synth_llama, dtype="float32", **{**SPEC, "speculative": "suffix"})
    outs = llm.generate(prompts, params)
    assert [(o.text, o.finish_reason) for o in outs] == want
    assert sum(o.finish_reason == "stop" for o in outs) >= 4
    assert llm.engine.stats().spec.num_accepted_tokens > 0
    _no_leaks(llm)
