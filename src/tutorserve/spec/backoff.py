"""When to draft: verifying drafts pays while a step is memory-bound (one more query row costs
little beside reading the weights) and stops paying once the batch makes it compute-bound. Where
that happens depends on the model, its weights' format, the hardware and how many drafts the
model keeps, so the engine asks a policy, chosen once by name:

- `fixed`: draft while at most `limit` requests run (vLLM's `disable_by_batch_size`);
- `measured`: below the same ceiling, compare what a step costs per output token with and
  without drafts, at the batch size of the step to come, and keep what is cheaper. Both are
  measured as the engine goes (a two-armed bandit per batch-size bucket): the arm that loses is
  still tried, so a change in acceptance or load is noticed; `explore_every` steps after it
  took the lead, then after twice as long each time it is still behind (up to
  `MAX_EXPLORE_EVERY`), since at a batch where drafting costs 3× a step, one try in 32 alone
  is 6 % of the time; and at once again after a try that beat the leader.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


class Backoff(ABC):
    def __init__(self, limit: int) -> None:
        self.limit = limit

    @abstractmethod
    def should_draft(self, batch: int) -> bool:
        """Whether a step's decode rows get drafts, when it will hold `batch` requests (those
        running and those about to join)."""

    def observe(self, batch: int, drafted: bool, seconds: float, tokens: int) -> None:  # noqa: B027
        """A decode step of `batch` requests ran `seconds` (the proposer's time in it) for
        `tokens` output tokens, after `should_draft` said `drafted`."""


class FixedBackoff(Backoff):
    def should_draft(self, batch: int) -> bool:
        return batch <= self.limit


@dataclass(slots=True)
class _Arm:
    """Seconds per output token of one choice over its recent steps: decayed sums of seconds and
    of tokens, whose ratio weighs a step by its tokens (a mean of per-step ratios would let the
    steps that kept no draft, costly per token, count as much as those that kept them all)."""

    DECAY = 0.9  # the last ~10 steps of this choice

    samples: int = 0
    seconds: float = 0.0
    tokens: float = 0.0

    def record(self, seconds: float, tokens: int) -> None:
        self.samples += 1
        self.seconds = self.DECAY * self.seconds + seconds
        self.tokens = self.DECAY * self.tokens + tokens

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else 0.0


@dataclass(slots=True)
class _Bucket:
    arms: tuple[_Arm, _Arm] = field(default_factory=lambda: (_Arm(), _Arm()))  # without, with
    leader: bool | None = None  # whether drafting was the cheaper choice at the last decision
    decisions: int = 0  # since the leader took the lead or the other choice was last tried
    period: int = 0  # decisions between tries of the other choice


class MeasuredBackoff(Backoff):
    WARMUP = 3  # steps each arm is measured before the averages decide
    MAX_EXPLORE_EVERY = 256

    def __init__(self, limit: int, explore_every: int = 32) -> None:
        super().__init__(limit)
        self.explore_every = explore_every
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        # 1, 2–3, 4–7, 8–15, …: a step's cost per row changes little within one
        return batch.bit_length()

    def should_draft(self, batch: int) -> bool:
        if batch > self.limit:
            return False
        b = self.buckets.setdefault(self.bucket(batch), _Bucket())
        without, with_ = b.arms
        if min(without.samples, with_.samples) < self.WARMUP:
            return with_.samples <= without.samples
        better = with_.per_token < without.per_token
        if better != b.leader:
            b.leader, b.decisions, b.period = better, 0, self.explore_every
        b.decisions += 1
        if b.decisions < b.period:
            return better
        b.decisions, b.period = 0, min(2 * b.period, self.MAX_EXPLORE_EVERY)
        return not better

    def observe(self, batch: int, drafted: bool, seconds: float, tokens: int) -> None:
        if batch > self.limit or tokens <= 0:
            return
        b = self.buckets.setdefault(self.bucket(batch), _Bucket())
        b.arms[drafted].record(seconds, tokens)
        lead = b.leader
        if lead is not None and drafted != lead and seconds / tokens < b.arms[lead].per_token:
            # A try that beat the leader: try again at once, so that a change shows within a
            # few steps (the other choice's decayed average moves a tenth a try), not a few tries.
            b.decisions, b.period = 0, 1


BACKOFFS: dict[str, type[Backoff]] = {"fixed": FixedBackoff, "measured": MeasuredBackoff}


def backoff_named(name: str, limit: int) -> Backoff:
    if name not in BACKOFFS:
        raise ValueError(f"speculative_backoff must be one of {', '.join(BACKOFFS)}, got {name!r}")
    return BACKOFFS[name](limit)
