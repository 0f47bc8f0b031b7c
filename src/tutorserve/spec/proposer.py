"""What the engine asks of a proposer, and tells it."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Proposer(ABC):
    """Each request comes with a scope: requests of one scope (by default, those whose prompts
    start alike: one course's students) may draft from each other's outputs."""

    @abstractmethod
    def propose(self, request: str, scope: bytes, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `tokens` (the request's prompt and output so far);
        fewer, or none, when there is no good guess: every drafted token costs a query row."""

    # Hooks a proposer that learns across requests overrides; the others ignore them.
    def observe(  # noqa: B027
        self, request: str, scope: bytes, tokens: list[int], num_prompt: int
    ) -> None:
        """The request's tokens after a step that gave it new ones (output from `num_prompt`)."""

    def feedback(self, scope: bytes, drafted: int, accepted: int) -> None:  # noqa: B027
        """How many of a request's drafted tokens the model kept."""
