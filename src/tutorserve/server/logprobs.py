"""Log-probabilities in the OpenAI API's two shapes: chat's `logprobs.content` and the legacy
completions object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

from typing import Any

from tutorserve.engine.outputs import TokenLogprob
from tutorserve.models.tokenizer import Tokenizer

# JSON has no -inf; a token the request's constraints forbid reports this instead (as vLLM).
_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def _entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode(errors="replace"), "logprob": _lp(logprob), "bytes": list(raw)}


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            _entry(tokenizer, e.token_id, e.logprob)
            | {"top_logprobs": [_entry(tokenizer, t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprob], text_offset: int, first: int | None = None
) -> dict[str, Any]:
    """`text_offset`: where the first token's text starts in the choice's text. `first`: a
    prompt's first token, which nothing predicts (echo: its log-probability is null)."""
    ids = ([] if first is None else [first]) + [e.token_id for e in entries]
    tokens = [tokenizer.token_bytes(t).decode(errors="replace") for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    head: list[None] = [] if first is None else [None]
    return {
        "tokens": tokens,
        "token_logprobs": head + [_lp(e.logprob) for e in entries],
        "top_logprobs": head
        + [
            {tokenizer.token_bytes(t).decode(errors="replace"): _lp(lp) for t, lp in e.top}
            for e in entries
        ],
        "text_offset": offsets,
    }
