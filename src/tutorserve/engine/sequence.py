"""A request's state as the engine sees it (vLLM v1 style: no prefill/decode phases).

Each request has `num_computed_tokens` catching up with `len(token_ids)`: while it lags by more
than one token the request is prefilling (possibly in chunks); once it reaches the end a token is
sampled and appended, so decode is just the one-token case of the same rule.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from tutorserve.engine.outputs import TokenLogprob
from tutorserve.sampling_params import SamplingParams
from tutorserve.structured import Matcher

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    # Cache-key extras folded into every block hash (e.g. an adapter id), so KV never mixes.
    cache_salt: bytes = b""
    # A student's conversation: its blocks are written through to the KV tiers when it ends.
    session_id: str | None = None
    lora: str | None = None  # adapter name; its fingerprint is the cache salt
    lora_slot: int = -1  # compute slot while admitted

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already published to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 until then
    num_preemptions: int = 0
    num_bypassed: int = 0  # admissions of later arrivals while this one waited
    first_token_time: float | None = None
    finish_time: float | None = None
    # Drafted next tokens (speculative decoding), verified in its next step; not yet tokens.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_scope: bytes = b""  # requests of one scope draft from each other's outputs
    logprobs: list[TokenLogprob] = field(default_factory=list)  # if params.logprobs is set
    # Prompt tokens 1.. (token 0 has nothing before it), if params.prompt_logprobs is set.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    matcher: Matcher | None = None  # where its output is in its grammar (structured outputs)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Lower is served first: priority, then arrival (preempted requests keep their place)."""
        return (self.priority, self.arrival_order)
