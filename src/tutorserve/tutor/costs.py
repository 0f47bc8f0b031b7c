"""What each model call of a turn cost, and who it is charged to.

An agent's run opens a `CallLog` (a context variable, so the model clients need no extra
arguments); the routing starts a `Call` for each model call and the client reports its tokens
into it. The service then charges the turn's calls to its learner, session, course, tenant,
agent and model: in the store, in the `CostLedger` (Prometheus) and on the agents' spans.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from contextvars import Context, ContextVar, copy_context
from dataclasses import dataclass, field

from tutorserve.tutor.tiers import Tier

# Prometheus label values beyond these many tenants or models are summed under "other", so a
# district of a thousand schools cannot blow up the scrape.
MAX_LABEL_VALUES = 32
OTHER = "other"
# What costs can be totalled by (`tutorserve tutor costs --by`).
DIMENSIONS = ("school", "course", "agent", "model", "tier", "learner", "session")


@dataclass(slots=True)
class Call:
    """One model call (or one reply served from the reply cache, `cached_reply`, whose tokens
    were saved rather than spent)."""

    agent: str
    tier: Tier
    model: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from the engine's prefix cache
    generated_tokens: int = 0
    seconds: float = 0.0
    cached_reply: bool = False
    saved_tokens: int = 0
    # Its reply is what the agent got (not a call that failed or lost to a hedge, whose
    # tokens were spent all the same).
    answered: bool = False

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


@dataclass(slots=True)
class CallLog:
    agent: str
    calls: list[Call] = field(default_factory=list)


_log: ContextVar[CallLog | None] = ContextVar("tutor_call_log", default=None)
# The call a model client's `report_usage` is charged to: each model call runs in a context of
# its own (`hedge.Attempt`), as two may run at once for one agent (a hedge).
_charged: ContextVar[Call | None] = ContextVar("tutor_charged_call", default=None)


def open_log(agent: str) -> CallLog:
    """Collect the model calls the current task makes from now on (an agent's run)."""
    log = CallLog(agent)
    _log.set(log)
    return log


def begin_call(tier: Tier, model: str, **done: object) -> Call | None:
    """A call charged to the running agent; None outside an agent (nothing to charge)."""
    log = _log.get()
    if log is None:
        return None
    call = Call(log.agent, tier, model, **done)  # type: ignore[arg-type]
    log.calls.append(call)
    return call


def charging(call: Call | None) -> Context:
    """A copy of the current context in which the model client's usage goes to `call`."""
    context = copy_context()
    context.run(_charged.set, call)
    return context


def answered_by(calls: list[Call]) -> str:
    """The model whose reply the agent used last (else the last one asked)."""
    return next((c.model for c in reversed(calls) if c.answered), calls[-1].model)


def logged_calls() -> list[Call]:
    """The running agent's calls so far (empty outside an agent)."""
    log = _log.get()
    return log.calls if log is not None else []


def report_usage(prompt: int, cached: int, generated: int) -> None:
    """A model client's token counts for the call it is serving."""
    if (call := _charged.get()) is not None:
        call.prompt_tokens, call.cached_tokens, call.generated_tokens = prompt, cached, generated


def span_attributes(calls: Iterable[Call]) -> dict[str, int | float | str]:
    calls = list(calls)
    return {
        "tutor.tokens.prompt": sum(c.prompt_tokens for c in calls),
        "tutor.tokens.cached": sum(c.cached_tokens for c in calls),
        "tutor.tokens.generated": sum(c.generated_tokens for c in calls),
        "tutor.tokens.saved": sum(c.saved_tokens for c in calls),
        "tutor.model_seconds": round(sum(c.seconds for c in calls), 4),
        "tutor.tiers": ",".join(sorted({c.tier.label for c in calls})),
    }


def usage_summary(calls: list[Call]) -> dict[str, int | float]:
    """A turn's costs, as its final event shows them."""
    spent = [c for c in calls if not c.cached_reply]
    return {
        "prompt_tokens": sum(c.prompt_tokens for c in spent),
        "cached_tokens": sum(c.cached_tokens for c in spent),
        "generated_tokens": sum(c.generated_tokens for c in spent),
        "model_seconds": round(sum(c.seconds for c in spent), 3),
        "cached_replies": sum(c.cached_reply for c in calls),
        "saved_tokens": sum(c.saved_tokens for c in calls),
    }


class CostLedger:
    """Running totals for Prometheus, per (tenant, course, agent, model, tier); tenant and model
    values beyond `MAX_LABEL_VALUES` are counted as "other". Thread-safe: turns are stored from
    worker threads."""

    KINDS = ("prompt", "cached", "generated")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (kind, tenant, course, agent, model, tier); the others without kind; turns by
        # (tenant, course).
        self.tokens: Counter[tuple[str, ...]] = Counter()
        self.seconds: Counter[tuple[str, ...]] = Counter()
        self.calls: Counter[tuple[str, ...]] = Counter()
        self.turns: Counter[tuple[str, ...]] = Counter()
        self._seen: dict[str, set[str]] = {"tenant": set(), "model": set()}

    def _bounded(self, kind: str, value: str) -> str:
        seen = self._seen[kind]
        if value in seen or len(seen) < MAX_LABEL_VALUES:
            seen.add(value)
            return value
        return OTHER

    def charge(self, tenant: str, course: str, calls: Iterable[Call], turn: bool) -> None:
        with self._lock:
            tenant = self._bounded("tenant", tenant)
            if turn:
                self.turns[(tenant, course)] += 1
            for c in calls:
                if c.cached_reply:
                    continue  # nothing spent; the reply cache's own metrics count the saving
                key = (tenant, course, c.agent, self._bounded("model", c.model), c.tier.label)
                self.calls[key] += 1
                self.seconds[key] += c.seconds
                for kind, n in zip(
                    self.KINDS, (c.prompt_tokens, c.cached_tokens, c.generated_tokens), strict=True
                ):
                    self.tokens[(kind, *key)] += n

    def snapshot(self) -> dict[str, dict[tuple[str, ...], float]]:
        with self._lock:
            return {
                "tokens": dict(self.tokens),
                "seconds": dict(self.seconds),
                "calls": dict(self.calls),
                "turns": dict(self.turns),
            }
