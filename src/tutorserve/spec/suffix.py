"""Suffix drafting across a class: the students of one course ask about the same problems, and
the tutor's hints for them repeat, so one student's reply drafts the next student's. Like suffix
decoding (Oliaro et al. 2024) it drafts from earlier outputs by matching the request's latest
tokens, here through an index of their n-grams (the longest n tried first), kept per scope and
bounded in tokens; and like it, a draft is as long as the match makes it likely to be kept: a
quarter of the tokens by which the request's latest ones agree with the earlier text (compared
back up to `MAX_MATCH`). On a class's tutor replies (`bench/suffix_replay.py`), 93 % of the
tokens drafted after an agreement of 64 were kept, half of those after one under 8, and each
drafted token costs about a quarter of a plain step on the default model's blocks
(docs/benchmarks/speculative.md). The request's own tokens are searched too (prompt lookup),
when its scope offers nothing, with drafts half as long as the n-gram matched.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count

from tutorserve.quant.layers import GEMV_ROWS_DEFAULT
from tutorserve.spec.ngram import longest_match
from tutorserve.spec.proposer import Proposer

_ENTRIES = 16  # occurrences remembered per n-gram (the latest)
_END_BITS = 32  # an occurrence is (text id << _END_BITS) | end position
_BYTES = 8  # an occurrence's size in the index (native byte order, as `array` reads it)
MAX_MATCH = 64  # tokens compared back from a match


@dataclass(slots=True)
class _Text:
    """A request's tokens (the engine's own list, which grows as it decodes: no copy per step),
    from `start` (the end of its prompt, so a reply's first tokens match too); n-grams ending
    before `indexed` are in the scope's index. `ident` names it in the index."""

    tokens: list[int]
    start: int
    indexed: int
    ident: int

    def __len__(self) -> int:
        return len(self.tokens) - self.start


def _occurrences(packed: bytes) -> array:
    return array("q", packed)


def _agreement(tokens: list[int], other: list[int], end: int) -> int:
    """How many tokens before the ends of `tokens` and of `other[:end]` are the same, up to
    MAX_MATCH (the index only knows that the last n-gram is, up to a hash collision)."""
    n = 0
    while n < MAX_MATCH and n < len(tokens) and n < end and tokens[-1 - n] == other[end - 1 - n]:
        n += 1
    return n


class _Scope:
    """The texts of one scope's requests, oldest first, and where each of their n-grams
    occurred. The index holds no object the garbage collector tracks (int keys: the n-gram's
    hash; bytes of packed occurrences): with tuples and lists, a class's worth of indexed
    tokens made each full collection of the server process walk them (137–162 ms pauses at
    batch 64, docs/benchmarks/speculative.md). Two n-grams with one hash only cost a rejected
    draft."""

    def __init__(self) -> None:
        self.texts: OrderedDict[str, _Text] = OrderedDict()
        self.by_ident: dict[int, _Text] = {}
        self.index: dict[int, bytes] = {}
        self.num_tokens = 0
        self._idents = count()

    def _grams(self, text: _Text, lo: int, hi: int, ns: range) -> Iterator[tuple[int, int]]:
        for end in range(max(lo, text.start + ns.start), hi):
            for n in ns:
                if end - n >= text.start:
                    yield hash(tuple(text.tokens[end - n : end])), end

    def add(self, request: str, tokens: list[int], start: int, ns: range) -> None:
        """Index the n-grams of the request's text that arrived since it was last seen."""
        text = self.texts.get(request)
        if text is None:
            text = _Text(tokens, start, start, next(self._idents))
            self.by_ident[text.ident] = text
        text.tokens = tokens  # the same list each step in the engine; a caller may pass a new one
        self.texts[request] = text
        self.texts.move_to_end(request)
        self.num_tokens += len(tokens) - max(text.indexed, start)
        tag = text.ident << _END_BITS
        for gram, end in self._grams(text, text.indexed, len(tokens), ns):
            kept = self.index.get(gram, b"")[-(_ENTRIES - 1) * _BYTES :]
            self.index[gram] = kept + (tag | end).to_bytes(_BYTES, sys.byteorder)
        text.indexed = len(tokens)

    def continuation(self, request: str, tokens: list[int], n: int, k: int) -> list[int]:
        """What followed the request's last `n` tokens most recently in another request's text,
        up to `k` tokens and a quarter of how far back the two texts agree."""
        mine = self.texts.get(request)
        for entry in reversed(_occurrences(self.index.get(hash(tuple(tokens[-n:])), b""))):
            text = self.by_ident.get(entry >> _END_BITS)
            end = entry & ((1 << _END_BITS) - 1)
            if text is not None and text is not mine and end < len(text.tokens):
                agree = _agreement(tokens, text.tokens, end)
                return text.tokens[end : end + min(k, max(1, agree // 4))]
        return []

    def evict(self, limit: int, keep: str, ns: range) -> None:
        """Drop the oldest texts but `keep`'s, and their index entries, until at most `limit`
        tokens remain."""
        while self.num_tokens > limit and len(self.texts) > 1:
            oldest = next(iter(self.texts))
            if oldest == keep:
                self.texts.move_to_end(oldest)
                continue
            text = self.texts.pop(oldest)
            del self.by_ident[text.ident]
            self.num_tokens -= text.indexed - text.start
            for gram, _ in self._grams(text, text.start, text.indexed, ns):
                if entries := self.index.get(gram):
                    left = [e for e in _occurrences(entries) if e >> _END_BITS != text.ident]
                    if left:
                        self.index[gram] = array("q", left).tobytes()
                    else:
                        del self.index[gram]


class SuffixProposer(Proposer):
    # 11: a request alone in its step then verifies at most 12 query rows, which a quantized LM
    # head (the default model's) multiplies on its blocks as it does a plain step's row, so the
    # logits are the same bits and greedy replies stay exact in bf16; above, the head runs a
    # dequantized GEMM, which rounds otherwise (with 16, tests/test_spec.py's request alone
    # verifies rows unlike plain decoding's).
    max_drafts = GEMV_ROWS_DEFAULT - 1

    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 8,
        max_tokens_per_scope: int = 1 << 16,
        max_scopes: int = 256,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("suffix n-gram sizes need 1 <= min_n <= max_n")
        self.ns = range(min_n, max_n + 1)
        self.max_tokens_per_scope, self.max_scopes = max_tokens_per_scope, max_scopes
        self._scopes: OrderedDict[bytes, _Scope] = OrderedDict()

    def observe(self, request: str, scope: bytes, tokens: list[int], num_prompt: int) -> None:
        s = self._scopes.get(scope)
        if s is None:
            s = self._scopes[scope] = _Scope()
            if len(self._scopes) > self.max_scopes:
                self._scopes.popitem(last=False)
        self._scopes.move_to_end(scope)
        s.add(request, tokens, max(0, num_prompt - self.ns.stop + 1), self.ns)
        s.evict(self.max_tokens_per_scope, request, self.ns)

    def propose(self, request: str, scope: bytes, tokens: list[int], k: int) -> list[int]:
        s, own = self._scopes.get(scope), None
        for n in reversed(self.ns):
            if len(tokens) < n:
                continue
            if s is not None and (drafts := s.continuation(request, tokens, n, k)):
                return drafts
            if own is None:  # the request's own longest match, looked for once
                own = longest_match(tokens, self.ns.start, n)
            if own[0] == n:
                return tokens[own[1] : own[1] + min(k, max(1, n // 2))]
        return []
