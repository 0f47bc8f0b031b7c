"""Token sampling: greedy, temperature, top-k, top-p, with optional per-request seeds; and the
verification of drafted tokens (speculative decoding).

Filtering is vectorised over the rows that sample; the final draw uses the exponential-race trick
(argmax of p / Exp(1)), drawn from the request's own generator when it has a seed so its output
does not depend on what else shares the batch.
"""

from __future__ import annotations

import torch

from tutorserve.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], default: torch.Generator) -> list[int]:
    """logits: [len(seqs), vocab] float32 → one token id per sequence."""
    out = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        probs = _probs(logits[rows], [seqs[i] for i in rows])
        for j, i in enumerate(rows):
            out[i] = _draw(probs[j], _generator(seqs[i], default))
    return out.tolist()


def verify(logits: torch.Tensor, seq: Sequence, default: torch.Generator) -> list[int]:
    """The tokens a row with drafts emits: logits [1 + drafts, vocab] at its last token and at
    each draft. Greedy: the drafts up to the first the model would not have picked, then the
    model's pick there (or after the last draft). Sampling: speculative (rejection) sampling for
    drafts from a deterministic proposer: draft d is kept with probability p(d), else the token
    is drawn from p without d, renormalised; so every emitted token has the distribution plain
    sampling gives it (Leviathan et al. 2023, with a one-hot draft distribution)."""
    drafts = seq.spec_token_ids
    if seq.params.greedy:
        picks = logits.argmax(dim=-1).tolist()
        n = next((j for j, d in enumerate(drafts) if d != picks[j]), len(drafts))
        return [*drafts[:n], picks[n]]
    probs = _probs(logits, [seq] * len(logits))
    gen = _generator(seq, default)
    for j, d in enumerate(drafts):
        if torch.rand((), generator=gen, device=probs.device) >= probs[j, d]:
            residual = probs[j].clone()
            residual[d] = 0.0
            return [*drafts[:j], _draw(residual, gen)]
    return [*drafts, _draw(probs[-1], gen)]


def _probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Each row's sampling distribution: its request's temperature, top-k and top-p."""
    temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
    logits = _top_k_top_p(
        logits / temps.unsqueeze(1), [s.params.top_k for s in seqs], [s.params.top_p for s in seqs]
    )
    return logits.softmax(dim=-1)


def _generator(seq: Sequence, default: torch.Generator) -> torch.Generator:
    if seq.params.seed is not None and seq.generator is None:
        seq.generator = torch.Generator(device=default.device).manual_seed(seq.params.seed)
    return seq.generator or default


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
