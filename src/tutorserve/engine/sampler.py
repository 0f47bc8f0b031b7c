"""Token sampling: greedy, temperature, top-k, top-p, with optional per-request seeds; and the
verification of drafted tokens (speculative decoding).

Filtering is vectorised over the rows that sample; the final draw uses the exponential-race trick
(argmax of p / Exp(1)). A request with a seed draws each token's noise from a generator seeded by
the seed and the token's position: its output depends neither on what else shares the batch nor
on whether, or how far, it speculated.
"""

from __future__ import annotations

import hashlib

import torch

from tutorserve.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], default: torch.Generator) -> list[int]:
    """logits: [len(seqs), vocab] float32 → one token id per sequence."""
    out = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        probs = _probs(logits[rows], [seqs[i] for i in rows])
        for j, i in enumerate(rows):
            out[i] = _draw(probs[j], _generator(seqs[i], len(seqs[i].token_ids), default))
    return out.tolist()


def verify(logits: torch.Tensor, seq: Sequence, default: torch.Generator) -> list[int]:
    """The tokens a row with drafts emits: logits [1 + drafts, vocab] at its last token and at
    each draft. The drafts up to the first that differs from what plain decoding picks there,
    then plain decoding's pick (or its pick after the last draft). With sampling, plain
    decoding's pick is a draw with the position's noise: every emitted token is the one plain
    sampling gives, so the distribution is unchanged, and with a seed the very tokens are. A
    draft from a deterministic proposer is kept with probability p(draft), as rejection sampling
    with a one-hot draft distribution keeps it (Leviathan et al. 2023)."""
    drafts = seq.spec_token_ids
    if seq.params.greedy:
        picks = logits.argmax(dim=-1).tolist()
    else:
        probs, picks, start = _probs(logits, [seq] * len(logits)), [], len(seq.token_ids)
        for j in range(len(logits)):  # draws stop at the first pick that differs
            picks.append(_draw(probs[j], _generator(seq, start + j, default)))
            if j == len(drafts) or picks[j] != drafts[j]:
                break
    n = next((j for j, d in enumerate(drafts) if d != picks[j]), len(drafts))
    return [*drafts[:n], picks[n]]


def _probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Each row's sampling distribution: its request's temperature, top-k and top-p."""
    temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
    logits = _top_k_top_p(
        logits / temps.unsqueeze(1), [s.params.top_k for s in seqs], [s.params.top_p for s in seqs]
    )
    return logits.softmax(dim=-1)


def _generator(seq: Sequence, position: int, default: torch.Generator) -> torch.Generator:
    """The noise of the token at `position`: from the request's seed and the position, when it
    has a seed; else the engine's generator."""
    if seq.params.seed is None:
        return default
    key = hashlib.blake2b(f"{seq.params.seed}:{position}".encode(), digest_size=8).digest()
    seed = int.from_bytes(key, "little") >> 1  # manual_seed takes a non-negative int64
    return torch.Generator(device=default.device).manual_seed(seed)


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """A token with probability proportional to `weights` (which need not sum to 1)."""
    noise = torch.empty_like(weights).exponential_(generator=gen)
    return int((weights / noise).argmax())


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.tensor([vocab if v == -1 else min(v, vocab) for v in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    # Top-p on what top-k left, renormalised (as transformers and vLLM order them): keep the
    # smallest set whose mass reaches top_p, i.e. drop a token once the mass before it does.
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    drop = (mass_before >= p) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
