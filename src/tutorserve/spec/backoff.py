"""When to draft: verifying drafts pays while a step is memory-bound (one more query row costs
little beside reading the weights) and stops paying once the batch makes it compute-bound. Where
that happens depends on the model, its weights' format, the hardware and how many drafts the
model keeps, so the engine asks a policy, chosen once by name:

- `fixed`: draft while at most `limit` requests run (vLLM's `disable_by_batch_size`);
- `measured`: below the same ceiling, draft while a drafted token saves more than it costs, at
  the batch size of the step to come. A drafted token is kept with probability α and then saves
  what a plain step spends per row, p; verifying it costs m. The engine's decode steps give, per
  batch-size bucket, p (steps that verified no drafts: seconds per row), m (steps with drafts:
  their seconds beyond p per row, per drafted token) and α (drafted tokens kept); drafting wins
  while α·p > m. The costs are the hardware's and are followed over the last ~10 steps; α is
  the workload's, and swings from request to request (a repeated reply is drafted whole, a new
  one hardly), so it is followed over ~50. Timing whole steps with drafts against steps
  without, per output token, as this policy did before, let a run of refused drafts switch
  drafting off where it still paid at any α above a quarter (batch 1 on the default model's
  blocks). The choice not taken is still tried now and then: `explore_every` decisions after
  the lead changed, then after twice as long each time it is still behind (up to
  `MAX_EXPLORE_EVERY`), and at once again after a try whose drafts paid.
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

    def observe(self, batch: int, drafts: int, seconds: float, tokens: int) -> None:  # noqa: B027
        """A decode step of `batch` rows verifying `drafts` drafted tokens in all ran `seconds`
        (the proposer's time in it) for `tokens` output tokens."""


class FixedBackoff(Backoff):
    def should_draft(self, batch: int) -> bool:
        return batch <= self.limit


@dataclass(slots=True)
class _Ratio:
    """A ratio of decayed sums over recent steps: a step weighs by its denominator (a mean of
    per-step ratios would let a step of one draft count as much as one of thirty)."""

    decay: float = 0.9  # 0.9: the last ~10 steps that gave a sample
    samples: int = 0
    num: float = 0.0
    den: float = 0.0

    def record(self, num: float, den: float) -> None:
        self.samples += 1
        self.num = self.decay * self.num + num
        self.den = self.decay * self.den + den

    @property
    def value(self) -> float:
        return self.num / self.den if self.den else 0.0


@dataclass(slots=True)
class _Bucket:
    per_row: _Ratio = field(default_factory=_Ratio)  # p: seconds per row, steps without drafts
    per_draft: _Ratio = field(default_factory=_Ratio)  # m: seconds beyond p per drafted token
    # α: drafted tokens kept, over the last ~50 steps with drafts: a reply drafted from nothing
    # alike refuses a run of drafts, which says little about the next request's
    kept: _Ratio = field(default_factory=lambda: _Ratio(decay=0.98))
    leader: bool | None = None  # whether drafting paid at the last decision
    decisions: int = 0  # since the leader took the lead or the other choice was last tried
    period: int = 0  # decisions between tries of the other choice

    def drafting_pays(self) -> bool:
        return self.kept.value * self.per_row.value > self.per_draft.value


class MeasuredBackoff(Backoff):
    WARMUP = 3  # steps each of p and m is measured on before the estimates decide
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
        if min(b.per_row.samples, b.per_draft.samples) < self.WARMUP:
            return b.per_draft.samples < b.per_row.samples  # p first: m is priced against it
        better = b.drafting_pays()
        if better != b.leader:
            b.leader, b.decisions, b.period = better, 0, self.explore_every
        b.decisions += 1
        if b.decisions < b.period:
            return better
        b.decisions, b.period = 0, min(2 * b.period, self.MAX_EXPLORE_EVERY)
        return not better

    def observe(self, batch: int, drafts: int, seconds: float, tokens: int) -> None:
        if batch > self.limit or tokens <= 0:
            return
        b = self.buckets.setdefault(self.bucket(batch), _Bucket())
        if not drafts:
            b.per_row.record(seconds, batch)
            return
        if not b.per_row.samples:
            return  # m is what a step costs beyond p: not known before p is
        extra = seconds - batch * b.per_row.value
        kept = max(0, tokens - batch)  # each row gives one token besides its kept drafts
        b.per_draft.record(extra, drafts)
        b.kept.record(kept, drafts)
        if b.leader is False and kept * b.per_row.value > extra:
            # A try whose drafts paid: try again at once, so that a rise in acceptance shows
            # within tens of steps (α's decayed sums move a fiftieth a try), not periods.
            b.decisions, b.period = 0, 1


BACKOFFS: dict[str, type[Backoff]] = {"fixed": FixedBackoff, "measured": MeasuredBackoff}


def backoff_named(name: str, limit: int) -> Backoff:
    if name not in BACKOFFS:
        raise ValueError(f"speculative_backoff must be one of {', '.join(BACKOFFS)}, got {name!r}")
    return BACKOFFS[name](limit)
