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

from tutorserve.spec.ngram import latest_match
from tutorserve.spec.proposer import Proposer

_ENTRIES = 16  # occurrences remembered per n-gram (the latest)


class _Scope:
    """Outputs of one scope's requests, each preceded by the end of its prompt (so a reply's
    first tokens match too), and where each n-gram of them occurred."""

    def __init__(self) -> None:
        self.texts: OrderedDict[str, list[int]] = OrderedDict()  # oldest request first
        self.index: dict[tuple[int, ...], list[tuple[str, int]]] = {}
        self.num_tokens = 0
        self.accepted = 2.0  # moving average of tokens accepted per draft

    def add(self, request: str, tokens: list[int], lo: int, hi: int, ns: range) -> None:
        """Index n-grams ending at positions lo..hi-1 of `tokens`, the request's text."""
        self.texts[request] = tokens
        self.texts.move_to_end(request)
        for end in range(max(lo, ns.start), hi):
            for n in ns:
                if n <= end:
                    entries = self.index.setdefault(tuple(tokens[end - n : end]), [])
                    entries.append((request, end))
                    del entries[:-_ENTRIES]

    def continuation(self, request: str, gram: tuple[int, ...], k: int) -> list[int]:
        """What followed `gram` most recently in another request's text."""
        for other, end in reversed(self.index.get(gram, ())):
            text = self.texts.get(other)
            if other != request and text is not None and end < len(text):
                return text[end : end + k]
        return []

    def evict(self, limit: int, keep: str, ns: range) -> list[str]:
        """Drop the oldest texts but `keep`'s, and their index entries, until at most `limit`
        tokens remain; the requests dropped."""
        dropped = []
        while self.num_tokens > limit and len(self.texts) > 1:
            oldest = next(iter(self.texts))
            if oldest == keep:
                self.texts.move_to_end(oldest)
                continue
            text = self.texts.pop(oldest)
            self.num_tokens -= len(text)
            for end in range(ns.start, len(text)):
                for n in ns:
                    gram = tuple(text[end - n : end])
                    if n <= end and (entries := self.index.get(gram)):
                        entries[:] = [e for e in entries if e[0] != oldest]
                        if not entries:
                            del self.index[gram]
            dropped.append(oldest)
        return dropped


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
        self._seen: dict[str, int] = {}  # tokens of each request already indexed

    def _scope(self, scope: bytes) -> _Scope:
        s = self._scopes.get(scope)
        if s is None:
            s = self._scopes[scope] = _Scope()
            if len(self._scopes) > self.max_scopes:
                for request in self._scopes.popitem(last=False)[1].texts:
                    self._seen.pop(request, None)
        self._scopes.move_to_end(scope)
        return s

    def observe(self, request: str, scope: bytes, tokens: list[int], num_prompt: int) -> None:
        s = self._scope(scope)
        start = max(0, num_prompt - self.ns.stop + 1)  # the prompt's end, then the output
        text = tokens[start:]
        seen = self._seen.get(request, 0)
        s.num_tokens += len(text) - len(s.texts.get(request, ()))
        s.add(request, text, seen, len(text), self.ns)
        self._seen[request] = len(text)
        for dropped in s.evict(self.max_tokens_per_scope, request, self.ns):
            del self._seen[dropped]

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
