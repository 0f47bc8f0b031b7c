"""Sampler (greedy, temperature, top-k/top-p against transformers' warpers, seeds) and
SamplingParams validation."""

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from tutorserve.engine.sampler import _top_k_top_p, sample
from tutorserve.engine.sequence import Sequence
from tutorserve.sampling_params import MAX_STOP_STRINGS, SamplingParams


def seq(rid="r", **params):
    return Sequence(str(rid), [1, 2, 3], SamplingParams(**params))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def random_logits(rows, vocab, seed, scale=3.0):
    return torch.randn(rows, vocab, generator=gen(seed)) * scale


def reference_kept(logits, k, p):
    """Kept-token mask of transformers' warpers, applied in their order: top-k, then top-p."""
    out = logits.clone()
    if k != -1:
        out = TopKLogitsWarper(top_k=k)(None, out)
    if p < 1.0:
        out = TopPLogitsWarper(top_p=p)(None, out)
    return torch.isfinite(out)


def near_top_p_boundary(row, k, p, eps=1e-5):
    """Rows whose sorted cumulative mass lands within eps of p are ambiguous in float32."""
    if p >= 1.0:
        return False
    vals = row.sort(descending=True).values
    if k != -1:
        vals = vals[:k]
    mass = vals.softmax(-1).cumsum(-1)
    full = row.softmax(-1).sort(descending=True).values.cumsum(-1)
    return bool(((mass - p).abs() < eps).any() or ((full - p).abs() < eps).any())


# ---- greedy ------------------------------------------------------------------------------


def test_greedy_rows_equal_argmax():
    logits = random_logits(6, 100, seed=1)
    seqs = [seq(i, temperature=0.0) for i in range(6)]
    assert sample(logits, seqs, gen()) == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = random_logits(8, 100, seed=2)
    seqs = [seq(i, temperature=1.5, top_k=1) for i in range(8)]
    assert sample(logits, seqs, gen(3)) == logits.argmax(-1).tolist()


def test_greedy_rows_unaffected_by_sampling_rows():
    logits = random_logits(6, 50, seed=4)
    seqs = [seq(i, temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = sample(logits, seqs, gen(5))
    argmax = logits.argmax(-1).tolist()
    assert [out[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]
    assert all(0 <= t < 50 for t in out)


def test_sample_does_not_modify_logits():
    logits = random_logits(3, 20, seed=6)
    before = logits.clone()
    sample(logits, [seq(0, top_k=3), seq(1, top_p=0.5), seq(2, temperature=0.0)], gen())
    assert torch.equal(logits, before)


# ---- top-k / top-p -----------------------------------------------------------------------


def check_against_reference(logits, ks, ps):
    out = _top_k_top_p(logits, ks, ps)
    assert out.shape == logits.shape
    compared = 0
    for r in range(logits.shape[0]):
        if near_top_p_boundary(logits[r], ks[r], ps[r]):
            continue
        ref = reference_kept(logits[r : r + 1], ks[r], ps[r])[0]
        kept = torch.isfinite(out[r])
        assert torch.equal(kept, ref), (r, ks[r], ps[r])
        # Kept logits pass through unchanged.
        assert torch.equal(out[r][kept], logits[r][kept])
        compared += 1
    assert compared >= logits.shape[0] - 1


@pytest.mark.parametrize(
    ("k", "p"),
    [(1, 1.0), (5, 1.0), (40, 1.0), (63, 1.0), (-1, 0.1), (-1, 0.5), (-1, 0.9), (-1, 0.99)],
)
def test_top_k_or_top_p_alone_matches_transformers(k, p):
    logits = random_logits(16, 64, seed=10 + k + int(p * 100), scale=1.5)
    check_against_reference(logits, [k] * 16, [p] * 16)


@pytest.mark.parametrize(("k", "p"), [(3, 0.8), (5, 0.9), (10, 0.5)])
def test_top_k_and_top_p_combined_match_transformers(k, p):
    logits = random_logits(16, 64, seed=20 + k)
    check_against_reference(logits, [k] * 16, [p] * 16)


def test_mixed_rows_filter_independently():
    # Each row has its own (k, p): only one combination per row, so the reference applies.
    ks = [-1, 3, -1, 7, 1, -1, 64, 20]
    ps = [0.3, 1.0, 0.95, 1.0, 1.0, 0.6, 1.0, 1.0]
    logits = random_logits(len(ks), 64, seed=30, scale=1.0)
    check_against_reference(logits, ks, ps)


def test_no_filtering_returns_logits_unchanged():
    logits = random_logits(4, 32, seed=31)
    assert torch.equal(_top_k_top_p(logits, [-1] * 4, [1.0] * 4), logits)
    assert torch.equal(_top_k_top_p(logits, [32, 32, 100, -1], [1.0] * 4), logits)


@pytest.mark.parametrize("case", ["batched_with_top_p_row", "top_k_at_least_vocab"])
def test_disabled_top_p_keeps_every_token(case):
    logits = torch.tensor([[10.0, 0.0, -20.0, -30.0], [10.0, 0.0, -20.0, -30.0]])
    if case == "batched_with_top_p_row":
        out = _top_k_top_p(logits, [-1, -1], [1.0, 0.5])
    else:
        out = _top_k_top_p(logits, [4, 100], [1.0, 1.0])
    assert torch.equal(out[0], logits[0])


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert torch.isfinite(_top_k_top_p(logits, [-1], [0.45])).tolist() == [
        [True, False, False, False]
    ]
    assert torch.isfinite(_top_k_top_p(logits, [-1], [0.7])).tolist() == [
        [True, True, False, False]
    ]
    assert torch.isfinite(_top_k_top_p(logits, [-1], [0.9])).tolist() == [[True, True, True, False]]


# ---- sampling distribution -----------------------------------------------------------------


def draw(logits_row, n, seed=0, **params):
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    seqs = [seq(i, **params) for i in range(n)]
    return torch.tensor(sample(logits, seqs, gen(seed)))


def chi_square(counts, probs):
    n = counts.sum()
    expected = probs * n
    mask = expected > 0
    assert counts[~mask].sum() == 0, "sampled a zero-probability token"
    return float((((counts - expected) ** 2)[mask] / expected[mask]).sum()), int(mask.sum()) - 1


# 99.9% quantiles of chi-square with 1..5 degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_sampling_matches_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, -0.5])
    n = 8_000
    tokens = draw(logits, n, seed=7, temperature=temperature)
    counts = torch.bincount(tokens, minlength=6).double()
    probs = (logits.double() / temperature).softmax(-1)
    stat, dof = chi_square(counts, probs)
    assert stat < CHI2_999[dof], (stat, counts.tolist(), (probs * n).tolist())


def test_top_k_sampling_matches_renormalized_softmax_and_never_leaves_top_k():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9, 1.2, -0.2, 0.0])
    n = 8_000
    tokens = draw(logits, n, seed=8, top_k=3, temperature=0.8)
    top3 = {1, 3, 5}
    assert set(tokens.tolist()) == top3
    counts = torch.bincount(tokens, minlength=8).double()
    masked = torch.full_like(logits, float("-inf"))
    masked[list(top3)] = logits[list(top3)]
    probs = (masked.double() / 0.8).softmax(-1)
    stat, dof = chi_square(counts, probs)
    assert stat < CHI2_999[dof]


def test_top_p_sampling_matches_renormalized_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    n = 8_000
    tokens = draw(logits, n, seed=9, top_p=0.75)
    counts = torch.bincount(tokens, minlength=4).double()
    probs = torch.tensor([0.5, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.8
    stat, dof = chi_square(counts, probs)
    assert stat < CHI2_999[dof]


def test_tokens_outside_top_k_never_sampled_random_logits():
    logits = random_logits(1, 200, seed=11, scale=1.0)[0]
    allowed = set(logits.topk(5).indices.tolist())
    tokens = draw(logits, 3000, seed=12, top_k=5, temperature=2.0)
    assert set(tokens.tolist()) == allowed


# ---- seeds -------------------------------------------------------------------------------


def run_steps(row_logits, target, others, default_seed, steps=12):
    """Sample `steps` times with `target` at row 0 next to `others`; the target's tokens."""
    out = []
    for t in range(steps):
        rows = [row_logits[t]] + [
            random_logits(1, row_logits.shape[1], seed=100 + t + j)[0] for j in range(len(others))
        ]
        out.append(sample(torch.stack(rows), [target, *others], gen(default_seed + t))[0])
        target.token_ids.append(out[-1])
    return out


def test_seeded_sampling_is_reproducible_and_batch_independent():
    vocab = 40
    row_logits = random_logits(12, vocab, seed=13, scale=0.5)  # flat: many plausible tokens
    alone = run_steps(row_logits, seq("a", seed=1234), [], default_seed=0)
    crowded = run_steps(
        row_logits,
        seq("a", seed=1234),
        [seq("x"), seq("y", seed=99, top_k=5), seq("z", temperature=0.0), seq("w", top_p=0.5)],
        default_seed=77,
    )
    assert alone == crowded
    other_seed = run_steps(row_logits, seq("a", seed=4321), [], default_seed=0)
    assert other_seed != alone
    assert len(set(alone)) > 3  # it really sampled rather than picking the argmax


def test_a_seeded_tokens_noise_follows_its_position():
    """A seeded request's token depends on the seed and its position only: the same position
    draws the same token whatever the engine's generator, the next positions fresh ones, and a
    request that reaches a position another way (as after speculation) draws the same there."""
    logits = random_logits(1, 30, seed=14, scale=0.3)
    s = seq("a", seed=5)
    assert sample(logits, [s], gen(1)) == sample(logits, [s], gen(2))
    draws = []
    for _ in range(12):
        draws += sample(logits, [s], gen())
        s.token_ids.append(draws[-1])
    assert len(set(draws)) > 1
    late = seq("b", seed=5)
    late.token_ids += draws[:6]
    assert sample(logits, [late], gen(9)) == [draws[6]]
    assert [sample(logits, [seq(i, seed=i)], gen())[0] for i in range(12)] != draws


def test_unseeded_rows_use_default_generator():
    logits = random_logits(8, 30, seed=15, scale=0.3)
    seqs = [seq(i) for i in range(8)]
    a = sample(logits, seqs, gen(3))
    assert sample(logits, [seq(i) for i in range(8)], gen(3)) == a
    assert sample(logits, [seq(i) for i in range(8)], gen(4)) != a


def test_tiny_temperature_behaves_like_greedy():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    assert sample(logits, [seq(0, temperature=1e-39)], gen()) == [1]


def test_small_temperature_is_nearly_greedy():
    logits = random_logits(4, 50, seed=16)
    out = sample(logits, [seq(i, temperature=1e-3) for i in range(4)], gen())
    assert out == logits.argmax(-1).tolist()


# ---- SamplingParams ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"max_tokens": 2.5},
        {"top_p": 0.0},
        {"top_p": -0.1},
        {"top_p": 1.01},
        {"top_p": float("nan")},
        {"temperature": -0.01},
        {"temperature": 2.01},
        {"temperature": float("nan")},
        {"top_k": 0},
        {"top_k": -2},
        {"stop": ["s"] * (MAX_STOP_STRINGS + 1)},
        {"stop": ["ok", ""]},
        {"stop": ""},
        {"stop": ["ok", 3]},
    ],
)
def test_sampling_params_rejects(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_k": -1},
        {"top_k": 1},
        {"stop": ["s"] * MAX_STOP_STRINGS},
    ],
)
def test_sampling_params_accepts_bounds(kwargs):
    SamplingParams(**kwargs)


def test_sampling_params_normalizes_stop_and_greedy():
    p = SamplingParams(stop="###")
    assert p.stop == ["###"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []  # no shared mutable default


def test_validate_catches_later_mutation():
    p = SamplingParams()
    p.max_tokens = 0
    with pytest.raises(ValueError):
        p.validate()
