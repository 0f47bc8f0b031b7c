"""Per-request sampling and stopping parameters (names follow vLLM and the OpenAI API)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # alternatives per token, as the OpenAI API allows
_MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What the output must match (vLLM's `structured_outputs`); exactly one kind is set.
    Frozen: compiled grammars are cached by it."""

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # a context-free grammar, in Lark or GBNF syntax

    def __post_init__(self) -> None:
        kinds = [self.json is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]  # fmt: skip
        if sum(kinds) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, grammar"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("choice needs at least one string")


class ParamError(ValueError):
    """A parameter the model cannot take; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Logits processing, in this order: bias, the ban on ending before min_tokens, penalties.
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    presence_penalty: float = 0.0  # OpenAI's: over output tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's (CTRL's): over prompt and output tokens
    # Log-probabilities of each sampled token and this many alternatives (None: none).
    logprobs: int | None = None
    # The same for each prompt token after the first (vLLM's): the prompt is then computed in
    # full, never served from the prefix cache.
    prompt_logprobs: int | None = None
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit 64 bits, got {self.seed}")  # torch's generator's
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
            raise ValueError("logit_bias keys must be non-negative token ids")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must lie in [-100, 100]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")

    def check_vocab(self, vocab_size: int) -> None:
        """ParamError if a token id the parameters name lies outside the model's vocabulary."""
        for param, ids in (
            ("logit_bias", self.logit_bias),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ParamError(
                    param, f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})"
                )

    @property
    def processes_logits(self) -> bool:
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def draftable(self) -> bool:
        """Whether speculative drafts may serve this request: verification samples rows of
        logits that only a grammar may mask (`constrain_drafts`), and reports no
        log-probabilities."""
        return not self.processes_logits and self.logprobs is None

    @property
    def greedy(self) -> bool:
        # Below ~1e-5, logits / T overflows; the limit of sampling there is argmax anyway.
        return self.temperature < _MIN_TEMPERATURE or self.top_k == 1
