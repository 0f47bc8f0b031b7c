"""What a request's parameters do to its logits before sampling, and the log-probabilities it
asked for.

Order: the structured-output grammar's mask, then (vLLM's order) logit bias, the ban on ending
before `min_tokens`, and the repetition, frequency and presence penalties. Log-probabilities are
taken after all of these and before temperature, top-k and top-p, so they describe the
distribution the request's own constraints define rather than how it happened to be sampled.
"""

from __future__ import annotations

import torch

from tutorserve.engine.outputs import TokenLogprob
from tutorserve.engine.sequence import Sequence
from tutorserve.structured import apply_bitmask, fill_bitmask


def process_logits(logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[int]) -> torch.Tensor:
    """logits [len(seqs), vocab] → the same, changed on the rows whose requests ask for it (a
    copy then; the model's logits stay as they were). `stop_ids`: the model's end tokens."""
    constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
    rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
    if not (rows or constrained):
        return logits
    logits = logits.clone()
    if constrained:  # first: the grammar decides what may come, the rest how likely it is
        bitmask = fill_bitmask([seqs[i].matcher for i in constrained], logits.shape[-1])
        apply_bitmask(logits, bitmask, constrained)
    for i in rows:
        _process_row(logits[i], seqs[i], stop_ids)
    return logits


def constrain_drafts(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The logit rows [1 + drafts, vocab] of a row verifying drafts, each masked to what the
    request's grammar allows after the drafts before it (a copy where it has a grammar)."""
    if seq.matcher is None:
        return logits
    logits = logits.clone()
    bitmask = seq.matcher.draft_bitmask(seq.spec_token_ids, logits.shape[-1])
    apply_bitmask(logits, bitmask, list(range(len(logits))))
    return logits


def _process_row(row: torch.Tensor, seq: Sequence, stop_ids: list[int]) -> None:
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=row.device))
    if seq.num_output_tokens < p.min_tokens:
        ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(stop_ids))
        row[list(ends)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(seq.token_ids, device=row.device).unique()
        picked = row[seen]
        # CTRL's rule: a seen token's logit moves toward zero by the factor, whatever its sign.
        row[seen] = torch.where(
            picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
        )
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        out = torch.tensor(seq.output_token_ids, device=row.device)
        counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def token_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]
) -> list[TokenLogprob | None]:
    """For each row whose request asked: the log-probability of its sampled token and of its
    `logprobs` most likely tokens."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return out
    k = max(seqs[i].params.logprobs for i in rows)
    for i, entry in zip(rows, logprobs_of(logits[rows], [tokens[i] for i in rows], k), strict=True):
        entry.top = entry.top[: seqs[i].params.logprobs]
        out[i] = entry
    return out


def logprobs_of(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Row i: the log-probability of token targets[i] under logits[i], and the k best."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp[torch.arange(len(targets)), torch.tensor(targets)].tolist()
    top_p, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    return [
        TokenLogprob(t, c, list(zip(ids, vals, strict=True)))
        for t, c, ids, vals in zip(targets, chosen, top_i.tolist(), top_p.tolist(), strict=True)
    ]
