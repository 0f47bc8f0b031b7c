"""What the engine returns per request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, seconds."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    metrics: RequestMetrics
    delta_text: str = ""  # text added by the step that produced this output (for streaming)
    logprobs: list[TokenLogprob] | None = None  # per output token, if the request asked
    # Per prompt token after the first (complete once the prompt is computed), if asked.
    prompt_logprobs: list[TokenLogprob] | None = None
    index: int = 0  # which of a request's n choices (set by the async front)


@dataclass(slots=True)
class TokenLogprob:
    """A sampled token's log-probability and the `logprobs` most likely tokens' (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
