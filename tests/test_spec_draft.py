"""Draft-model speculation (`--speculative draft:<model>`): greedy output identical to plain
decoding whatever the draft (the target itself, a perturbed copy, an unrelated model), with
prefix caching, preemption, LoRA and the context limit; the draft's KV is rolled back, bounded,
counted in the KV budget and freed when requests end; a draft of another vocabulary or a shorter
context is refused; seeded sampling stays reproducible; the CLI takes the option."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tutorserve import LLM, SamplingParams
from tutorserve.layers.attention.gather import GatherBackend
from tutorserve.lora.synth import synth_lora
from tutorserve.models.loader import load_model, load_model_config
from tutorserve.models.synth import SynthSpec, synth_model
from tutorserve.spec import DraftProposer, SpeculativeChoices, draft_model_name

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SPEC = {
    "num_speculative_tokens": 4,
    "speculative_disable_by_batch_size": 64,
    "speculative_backoff": "fixed",
}
F32 = (torch.float32, torch.float32, torch.device("cpu"))  # model, KV, device


def _perturbed(src: str, out: Path, std: float) -> str:
    """A copy of `src` with noise on every weight: same tokenizer, drafts right about a third
    of the time."""
    shutil.copytree(src, out)
    g = torch.Generator().manual_seed(0)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v + std * torch.randn(v.shape, generator=g) for k, v in tensors.items()}, f)
    return str(out)


@pytest.fixture(scope="module")
def drafts(synth_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    small = SynthSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=5)
    return {
        "self": synth_llama,
        "perturbed": _perturbed(synth_llama, root / "perturbed", 0.03),
        "unrelated": str(synth_model(root / "unrelated", small)),
    }


@pytest.fixture(scope="module")
def plain(synth_llama, mixed_prompts):
    llm = LLM(synth_llama, dtype="float32", enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(mixed_prompts, GREEDY)]


def _draft_llm(target: str, draft: str, **kw) -> LLM:
    return LLM(target, dtype="float32", speculative=f"draft:{draft}", **{**SPEC, **kw})


def _drafter(model_dir: str, num_blocks: int) -> DraftProposer:
    """A proposer over its own copy of the model (a proposer points the model's attention
    layers at its cache, so two proposers must not share one)."""
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    return DraftProposer(model, model.config.vocab_size, num_blocks, 16, *F32)


def _no_leaks(llm: LLM) -> None:
    pool, proposer = llm.engine.kv.pool, llm.engine.proposer
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks
    assert not llm.engine.has_unfinished()
    assert isinstance(proposer, DraftProposer)
    assert proposer.requests == {}
    proposer.pool.check_integrity()
    assert proposer.num_free_blocks == proposer.pool.num_blocks


@pytest.mark.parametrize(
    ("draft", "caching", "backend"),
    [
        ("self", True, "cpu-kernel"),
        ("perturbed", True, "cpu-kernel"),
        ("perturbed", False, "gather"),
        ("unrelated", True, "cpu-kernel"),
    ],
)
def test_greedy_output_is_identical_with_a_draft_model(
    synth_llama, drafts, mixed_prompts, plain, draft, caching, backend
):
    llm = _draft_llm(synth_llama, drafts[draft], enable_prefix_caching=caching)
    if backend == "gather":
        llm.engine.runner.backend = llm.engine.proposer.backend = GatherBackend()
    outs = llm.generate(mixed_prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    spec = llm.engine.stats().spec
    drafted, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
    assert drafted > 0
    if draft == "self":  # the target drafting for itself: every draft is what it then picks
        assert accepted == drafted
    elif draft == "perturbed":  # both kinds of step: drafts accepted, and drafts rejected
        assert 0.1 * drafted < accepted < 0.9 * drafted
    _no_leaks(llm)


def test_draft_kv_rolls_back_to_the_accepted_tokens_and_stays_in_its_pool(synth_llama):
    proposer = _drafter(synth_llama, 6)
    prompt = list(range(3, 33))  # 30 tokens
    drafts = proposer.propose("r", b"", prompt, 4)
    assert len(drafts) == 4
    kv = proposer.requests["r"]
    # Written: the prompt and the drafts but the last (whose K/V nothing reads yet).
    assert kv.tokens == prompt + drafts[:3] and len(kv.table) == 3
    # The engine kept one draft, rejected the next, and (speculation paused by a busy batch)
    # decoded two more steps without drafts: the draft's KV is rolled back to the prompt and
    # the kept draft, and continues from there.
    other = 300 if drafts[1] != 300 else 301
    tokens = [*prompt, drafts[0], other, 302, 303]
    again = proposer.propose("r", b"", tokens, 2)
    assert kv.tokens == tokens + again[:1] and kv.fixed == len(tokens)
    assert len(kv.table) == 3 and proposer.num_free_blocks == 3
    # A drafter's greedy tokens equal a fresh drafter's over the same tokens (rollback is
    # complete: no stale K/V of a rejected draft is read).
    fresh = _drafter(synth_llama, 6)
    assert fresh.propose("x", b"", tokens, 4) == proposer.propose("r", b"", tokens, 4)
    # The pool is bounded: with too few blocks left, no drafts, and nothing taken.
    assert proposer.propose("other", b"", list(range(3, 70)), 4) == []
    assert proposer.num_free_blocks == 3
    proposer.release("r")
    proposer.release("other")
    assert proposer.num_free_blocks == 6 and not proposer.requests


def test_draft_kv_caches_shared_prefixes_and_drafts_as_if_computed(synth_llama):
    """A second student of the course reads the course prompt's blocks the first one wrote
    (its drafts equal a fresh drafter's), after the first left too; an unrelated prompt
    evicts them when the pool needs its blocks, and every block comes back."""
    proposer = _drafter(synth_llama, 8)
    course = list(range(3, 43))  # 40 tokens: two full blocks and a part
    first = [*course, 50, 51]
    proposer.propose("a", b"", first, 3)
    assert proposer.cached_tokens == 0
    second = [*course, 60, 61, 62]

    def fresh(tokens: list[int]) -> list[int]:
        return _drafter(synth_llama, 8).propose("x", b"", tokens, 3)

    assert proposer.propose("b", b"", second, 3) == fresh(second)
    assert proposer.cached_tokens == 32  # the two full blocks; the third differs
    a, b = proposer.requests["a"], proposer.requests["b"]
    assert a.table[:2] == b.table[:2] and a.table[2] != b.table[2]
    assert proposer.num_free_blocks == 8 - 4  # three for "a", one more for "b"
    proposer.release("a")
    proposer.release("b")
    assert proposer.num_free_blocks == 8
    # Both gone: the blocks stay cached while nobody needs them.
    third = [*course, 70]
    assert proposer.propose("c", b"", third, 3) == fresh(third)
    assert proposer.cached_tokens == 64
    # Every token in cached blocks: the last block is computed again, for the last logits.
    exact = course[:32]
    assert proposer.propose("e", b"", exact, 3) == fresh(exact)
    assert proposer.cached_tokens == 64 + 16
    proposer.release("c")
    proposer.release("e")
    # A prompt that needs every block takes the cached ones too, and drafts right.
    other = list(range(100, 220))
    assert proposer.propose("d", b"", other, 3) == fresh(other)
    assert proposer.pool.lookup(a.hashes[0]) is None
    proposer.release("d")
    proposer.pool.check_integrity()
    assert proposer.num_free_blocks == 8 and not proposer.requests


def test_a_requests_draft_length_follows_what_the_model_accepts(synth_llama):
    """Drafts as long as the request's recent drafts were accepted, plus two (suffix's rule):
    rejected ones shrink the next to two tokens, accepted ones grow it back; per request."""
    proposer = _drafter(synth_llama, 16)
    prompt = list(range(3, 33))
    assert len(proposer.propose("r", b"", prompt, 4)) == 4
    for _ in range(20):
        proposer.feedback("r", b"", 4, 0)
    assert len(proposer.propose("r", b"", prompt, 4)) == 2
    assert len(proposer.propose("s", b"", prompt, 4)) == 4  # another request: its own average
    for _ in range(20):
        proposer.feedback("r", b"", 4, 4)
    assert len(proposer.propose("r", b"", prompt, 4)) == 4


def test_a_gguf_draft_kept_in_its_quantized_blocks():
    """SmolLM2 drafting for itself from its GGUF blocks (its parameters are bytes, its
    activations float32): same greedy tokens as without drafts."""
    prompts = ["Explain why 2 + 3 = 5 to a child.", "Solve x^2 - 5x + 6 = 0."]
    model, kw = "smollm2-135m-instruct", {"dtype": "float32", "kv_cache_bytes": 64 << 20}
    want = [o.token_ids for o in LLM(model, **kw).generate(prompts, GREEDY)]
    llm = LLM(model, speculative=f"draft:{model}", **kw, **SPEC)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    spec = llm.engine.stats().spec
    assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    _no_leaks(llm)


def test_drafts_of_a_batch_equal_each_rows_own(synth_llama, mixed_prompts):
    """Rows drafted together (decode rows and prompt catch-ups in one forward, rows dropping
    out at their own k) get the drafts each gets alone."""
    together, alone = (_drafter(synth_llama, 64) for _ in range(2))
    rows = [(f"r{i}", b"", p, 1 + i % 4) for i, p in enumerate(mixed_prompts[:6])]
    for _ in range(3):  # the first round catches up on prompts; later ones decode
        got = together.propose_batch(rows)
        assert got == [alone.propose(*row) for row in rows]
        assert [len(d) for d in got] == [k for *_, k in rows]
        rows = [(r, s, [*t, *d[:1], 7], k) for (r, s, t, k), d in zip(rows, got, strict=True)]


def test_the_draft_kv_comes_out_of_the_engines_kv_budget(synth_llama, drafts):
    budget = 1 << 20
    plain = LLM(synth_llama, dtype="float32", kv_cache_bytes=budget)
    llm = _draft_llm(synth_llama, drafts["unrelated"], kv_cache_bytes=budget)
    models = (synth_llama, drafts["unrelated"])
    per_token = [load_model_config(m).kv_bytes_per_token(4) for m in models]
    blocks = llm.engine.kv.pool.num_blocks
    assert blocks == budget // (sum(per_token) * 16) < plain.engine.kv.pool.num_blocks
    assert llm.engine.proposer.pool.num_blocks == blocks
    both = llm.engine.runner.k_cache.numel() * 8 + llm.engine.proposer.k_cache.numel() * 8
    assert both <= budget


def test_draft_speculation_under_preemption(synth_llama, drafts, mixed_prompts, plain):
    llm = _draft_llm(
        synth_llama, drafts["perturbed"], num_kv_blocks=24, max_model_len=384,
        max_num_batched_tokens=64,
    )  # fmt: skip
    released: list[str] = []
    release = llm.engine.proposer.release
    llm.engine.proposer.release = lambda r: (released.append(r), release(r))[1]
    outs = llm.generate(mixed_prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().spec.num_accepted_tokens > 0
    assert [o.token_ids for o in outs] == plain
    # Each request released once at its end, and once more per preemption.
    assert len(released) == len(mixed_prompts) + llm.engine.scheduler.num_preemptions
    _no_leaks(llm)


def test_draft_speculation_stops_at_the_context_limit_and_max_tokens(
    synth_llama, drafts, mixed_prompts
):
    near_the_limit = list(range(3, 161))  # 158 tokens: room for 2 more
    prompts = [*[p for p in mixed_prompts if 40 < len(p) < 130][:3], near_the_limit]
    for params in (
        SamplingParams(temperature=0, max_tokens=500, ignore_eos=True),  # runs into max_model_len
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ):
        want = LLM(synth_llama, dtype="float32", max_model_len=160).generate(prompts, params)
        llm = _draft_llm(synth_llama, drafts["self"], max_model_len=160)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in want]
        assert all(len(p) + len(o.token_ids) <= 160 for p, o in zip(prompts, outs, strict=True))
        assert llm.engine.stats().spec.num_drafts > 0
        _no_leaks(llm)


def test_draft_model_drafts_are_verified_with_the_rows_adapter(
    synth_llama, drafts, mixed_prompts, tmp_path
):
    cfg = load_model_config(synth_llama)
    loras = {f"l{i}": str(synth_lora(tmp_path / f"l{i}", cfg, 8, seed=i, strength=1.5))
             for i in range(2)}  # fmt: skip
    lora = [[None, "l0", "l1"][i % 3] for i in range(6)]

    def run(**kw):
        llm = LLM(synth_llama, dtype="float32", lora_modules=loras, **kw)
        return llm, [o.token_ids for o in llm.generate(mixed_prompts[:6], GREEDY, lora=lora)]

    _, want = run()
    llm, got = run(speculative=f"draft:{drafts['self']}", **SPEC)
    assert got == want
    spec = llm.engine.stats().spec
    # The draft is the base model: it misses where an adapter changes the choice.
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    _no_leaks(llm)


def test_a_draft_of_another_vocabulary_or_a_shorter_context_is_refused(synth_llama, tmp_path):
    tiny = {"layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1}
    other = synth_model(tmp_path / "vocab300", SynthSpec(vocab=300, **tiny))  # other merges
    with pytest.raises(ValueError, match=r"another vocabulary.*share the target's tokenizer"):
        LLM(synth_llama, dtype="float32", speculative=f"draft:{other}")
    # The target's tokenizer, but fewer embedding rows than the target's 512.
    fewer = synth_model(tmp_path / "vocab480", SynthSpec(vocab=480, **tiny))
    with pytest.raises(ValueError, match="embeds 480 token ids, fewer than the target's 512"):
        LLM(synth_llama, dtype="float32", speculative=f"draft:{fewer}")
    # More rows (padded otherwise) are fine: the draft never proposes an id past 512.
    more = synth_model(tmp_path / "vocab600", SynthSpec(vocab=600, **tiny))
    llm = LLM(synth_llama, dtype="float32", speculative=f"draft:{more}")
    assert len(llm.generate([list(range(3, 40))], GREEDY)[0].token_ids) == 40
    short = synth_model(tmp_path / "short", SynthSpec(max_position_embeddings=128, **tiny))
    with pytest.raises(ValueError, match="holds 128 positions, below max_model_len 160"):
        LLM(synth_llama, dtype="float32", speculative=f"draft:{short}", max_model_len=160)
    with pytest.raises(ValueError, match="needs a model name"):
        LLM(synth_llama, dtype="float32", speculative="draft:")
    assert draft_model_name("ngram") is None and draft_model_name("draft:a/b") == "a/b"
    assert "draft:x" in SpeculativeChoices() and "draft:" not in SpeculativeChoices()


def test_seeded_sampling_with_a_draft_model_is_reproducible(synth_llama, drafts, mixed_prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = _draft_llm(synth_llama, drafts["perturbed"])
        runs.append([o.token_ids for o in llm.generate(mixed_prompts[:4], params)])
        assert llm.engine.stats().spec.num_accepted_tokens > 0
    assert runs[0] == runs[1]


def test_the_cli_takes_a_draft_model(synth_llama, drafts):
    args = ["--model", synth_llama, "--dtype", "float32", "--max-tokens", "8", "--raw",
            "--temperature", "0", "--prompt", "The tutor asks"]  # fmt: skip
    plain = subprocess.run([sys.executable, "-m", "tutorserve.cli", "generate", *args],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "tutorserve.cli", "generate", *args,
         "--speculative", f"draft:{drafts['self']}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plain.returncode == 0 and r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout and r.stdout.strip()
    bad = subprocess.run(
        [sys.executable, "-m", "tutorserve.cli", "generate", *args, "--speculative", "medusa"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode != 0 and "draft:MODEL" in bad.stderr
