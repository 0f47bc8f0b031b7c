"""Suffix drafting across a class: the students of one course ask about the same problems, and
the tutor's hints for them repeat, so one student's reply drafts the next student's. Like suffix
decoding (Oliaro et al. 2024) it drafts from earlier outputs by matching the request's latest
tokens, here through an index of their n-grams (the longest n tried first), kept per scope and
bounded in tokens; and like it, the draft length follows how much of a scope's drafts the model
has been accepting. The request's own tokens are searched too (prompt lookup), when its scope
offers nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from tutorserve.spec.ngram import latest_match
from tutorserve.spec.proposer import Proposer

_ENTRIES = 16  # occurrences remembered per n-gram (the latest)


@dataclass(slots=True)
class _Text:
    """A request's tokens (the engine's own list, which grows as it decodes: no copy per step),
    from `start` (the end of its prompt, so a reply's first tokens match too); n-grams ending
    before `indexed` are in the scope's index."""

    tokens: list[int]
    start: int
    indexed: int

    def __len__(self) -> int:
        return len(self.tokens) - self.start


class _Scope:
    """The texts of one scope's requests, oldest first, and where each of their n-grams
    occurred (positions in the request's tokens)."""

    def __init__(self) -> None:
        self.texts: OrderedDict[str, _Text] = OrderedDict()
        self.index: dict[tuple[int, ...], list[tuple[str, int]]] = {}
        self.num_tokens = 0
        self.accepted = 2.0  # moving average of tokens accepted per draft

    def _grams(self, text: _Text, lo: int, hi: int, ns: range) -> Iterator[tuple[tuple, int]]:
        for end in range(max(lo, text.start + ns.start), hi):
            for n in ns:
                if end - n >= text.start:
                    yield tuple(text.tokens[end - n : end]), end

    def add(self, request: str, tokens: list[int], start: int, ns: range) -> None:
        """Index the n-grams of the request's text that arrived since it was last seen."""
        text = self.texts.get(request) or _Text(tokens, start, start)
        text.tokens = tokens  # the same list each step in the engine; a caller may pass a new one
        self.texts[request] = text
        self.texts.move_to_end(request)
        self.num_tokens += len(tokens) - max(text.indexed, start)
        for gram, end in self._grams(text, text.indexed, len(tokens), ns):
            entries = self.index.setdefault(gram, [])
            entries.append((request, end))
            del entries[:-_ENTRIES]
        text.indexed = len(tokens)

    def continuation(self, request: str, gram: tuple[int, ...], k: int) -> list[int]:
        """What followed `gram` most recently in another request's text."""
        for other, end in reversed(self.index.get(gram, ())):
            text = self.texts.get(other)
            if other != request and text is not None and end < len(text.tokens):
                return text.tokens[end : end + k]
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
            self.num_tokens -= text.indexed - text.start
            for gram, _ in self._grams(text, text.start, text.indexed, ns):
                if entries := self.index.get(gram):
                    entries[:] = [e for e in entries if e[0] != oldest]
                    if not entries:
                        del self.index[gram]


class SuffixProposer(Proposer):
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
        s = self._scopes.get(scope)
        if s is not None and s.texts:
            # Drafts as long as this scope's drafts have recently been accepted, plus two.
            k = min(k, int(s.accepted) + 2)
        if k <= 0:
            return []
        for n in reversed(self.ns):
            if len(tokens) < n:
                continue
            if s is not None and (drafts := s.continuation(request, tuple(tokens[-n:]), k)):
                return drafts
            if drafts := latest_match(tokens, n, k):
                return drafts
        return []

    def feedback(self, scope: bytes, drafted: int, accepted: int) -> None:
        s = self._scopes.get(scope)
        if s is not None:
            s.accepted = 0.8 * s.accepted + 0.2 * accepted
