"""Token sampling: greedy, temperature, top-k, top-p, with optional per-request seeds.

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
        sub = logits[rows]
        temps = torch.tensor([seqs[i].params.temperature for i in rows], device=sub.device)
        sub = sub / temps.unsqueeze(1)
        sub = _top_k_top_p(
            sub,
            [seqs[i].params.top_k for i in rows],
            [seqs[i].params.top_p for i in rows],
        )
        probs = sub.softmax(dim=-1)
        for j, i in enumerate(rows):
            seq = seqs[i]
            if seq.params.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(device=probs.device).manual_seed(seq.params.seed)
            gen = seq.generator or default
            noise = torch.empty_like(probs[j]).exponential_(generator=gen)
            out[i] = (probs[j] / noise).argmax()
    return out.tolist()


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
