"""Prompt lookup (n-gram) drafting: tutor replies quote the problem, the student's words and the
course's worked steps, so the tokens after the last few generated ones often appeared earlier in
the same request. vLLM, SGLang and llama.cpp ship the same idea ("prompt lookup decoding")."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tutorserve.spec.proposer import Proposer


def latest_match(tokens: list[int], n: int, k: int) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of the last `n`."""
    if len(tokens) <= n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # Windows that end before the last token, so a match has at least one follower.
    starts = np.flatnonzero((sliding_window_view(arr[:-1], n) == arr[-n:]).all(axis=1))
    if not len(starts):
        return []
    follow = starts[-1] + n
    return arr[follow : follow + k].tolist()


class NgramProposer(Proposer):
    """Finds the latest earlier occurrence of the request's last n tokens (longest n first,
    `max_n` down to `min_n`) and drafts the tokens that followed it."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram sizes need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request: str, scope: bytes, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if drafts := latest_match(tokens, n, k):
                return drafts
        return []
