"""What the engine asks of a proposer, and tells it."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass

# Unnamed requests whose prompts share their first this many tokens (one course's system prompt
# and the start of its material) share a scope.
SCOPE_TOKENS = 256


def scope_key(prompt: list[int], name: str | None, salt: bytes = b"") -> bytes:
    """A request's scope: its name's, when it gives one (the tutor names course, problem and
    rung), else its prompt start's; `salt` keeps adapters apart (their outputs differ)."""
    h = hashlib.blake2b(salt, digest_size=16)
    if name is None:
        h.update(b"prompt:" + array("i", prompt[:SCOPE_TOKENS]).tobytes())
    else:
        h.update(b"name:" + name.encode())
    return h.digest()


@dataclass(slots=True)
class AcceptanceAverage:
    """Tokens accepted per draft, as a moving average; drafts are kept as long as that, plus two
    (suffix decoding's rule: drafting past what the model keeps costs query rows for nothing)."""

    accepted: float = 2.0

    def record(self, accepted: int) -> None:
        self.accepted = 0.8 * self.accepted + 0.2 * accepted

    def draft_length(self, k: int) -> int:
        return min(k, int(self.accepted) + 2)


class Proposer(ABC):
    """Each request comes with a scope: requests of one scope (by default, those whose prompts
    start alike: one course's students) may draft from each other's outputs."""

    max_drafts = 4  # drafts a row may get, where the engine's num_speculative_tokens is unset

    @abstractmethod
    def propose(self, request: str, scope: bytes, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `tokens` (the request's prompt and output so far);
        fewer, or none, when there is no good guess: every drafted token costs a query row."""

    def propose_batch(self, rows: list[tuple[str, bytes, list[int], int]]) -> list[list[int]]:
        """`propose` for each (request, scope, tokens, k): a proposer that runs a model
        overrides it to draft every row in the same forwards."""
        return [self.propose(*row) for row in rows]

    # Hooks a proposer that learns across requests overrides; the others ignore them.
    def observe(  # noqa: B027
        self, request: str, scope: bytes, tokens: list[int], num_prompt: int
    ) -> None:
        """The request's tokens after a step that gave it new ones (output from `num_prompt`)."""

    def feedback(  # noqa: B027
        self, request: str, scope: bytes, drafted: int, accepted: int
    ) -> None:
        """How many of a request's drafted tokens the model kept."""

    def release(self, request: str) -> None:  # noqa: B027
        """The request finished, was aborted or was preempted: drop what is kept for it alone
        (a draft model's KV); a later `propose` for it starts over."""
