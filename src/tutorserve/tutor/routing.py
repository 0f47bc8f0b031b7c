"""Which model answers an agent call: the tiering policy picks a tier from the learner's state,
a quota may cap it, and each model endpoint's circuit breaker may push the call down a tier
(large → small → authored) at once. The reply cache sits beside it: a call whose reply is
already known costs no model at all.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any

from tutorserve.tutor.breaker import BreakerConfig, CircuitBreaker
from tutorserve.tutor.hedge import Attempt, FirstTokenLatency, HedgeConfig
from tutorserve.tutor.llm_client import ChatLLM, Messages
from tutorserve.tutor.reply_cache import ReplyCache
from tutorserve.tutor.tiers import Situation, Tier, TieringPolicy, Uniform

log = logging.getLogger(__name__)
Probe = tuple[Messages, dict[str, Any]]  # a call's messages and options, to probe a model with


class AllTiersDown(RuntimeError):
    """No model tier can take the call now: the agent serves its authored text."""


def endpoint_failed(e: BaseException) -> bool:
    """Whether an error says the endpoint is unwell (down, late, 5xx), not that this request was
    bad (a prompt too long, a 4xx): only the former counts against its breaker."""
    if isinstance(e, ValueError):
        return False
    return getattr(e, "status_code", 500) >= 500


class Routing:
    """`models`: the chat model of each model tier; a tier left out is served by the other's
    model. A breaker per distinct model, so a failing large model does not close the small
    one."""

    def __init__(
        self,
        models: Mapping[Tier, ChatLLM],
        policy: TieringPolicy | None = None,
        breaker: BreakerConfig | None = None,
        cache: ReplyCache | None = None,
        hedge: HedgeConfig | None = None,
    ) -> None:
        if not models or Tier.AUTHORED in models:
            raise ValueError("routing needs a model for the small or the large tier")
        self.models = dict(models)
        for tier, other in ((Tier.SMALL, Tier.LARGE), (Tier.LARGE, Tier.SMALL)):
            self.models.setdefault(tier, self.models.get(other))  # type: ignore[arg-type]
        self.policy = policy or Uniform()
        self.cache = cache
        self.breaker_config = breaker = breaker or BreakerConfig()
        self.breakers = {id(m): CircuitBreaker(breaker) for m in self.models.values()}
        # Hedging needs a model tier below to send the call to.
        self.latency = (
            {id(m): FirstTokenLatency(hedge) for m in self.models.values()}
            if hedge is not None and self.models[Tier.SMALL] is not self.models[Tier.LARGE]
            else {}
        )
        self._side: set[asyncio.Task] = set()  # probes and watches

    @classmethod
    def single(cls, llm: ChatLLM, **kw: Any) -> Routing:
        """One model for every tier: the tutor before tiering."""
        return cls({Tier.LARGE: llm}, **kw)

    def tier(self, s: Situation, cap: Tier = Tier.LARGE) -> Tier:
        """The policy's tier for `s`, no higher than `cap` (a tenant over quota is degraded)."""
        return min(self.policy.tier(s), cap)

    def serving(
        self, wanted: Tier, skip: frozenset[int] = frozenset(), probe: Probe | None = None
    ) -> tuple[Tier, ChatLLM]:
        """The tier and model that answer a call wanted at `wanted`: the first one down whose
        breaker is closed; AllTiersDown when none is. A half-open model passed on the way is
        sent `probe`'s call on the side."""
        tier = wanted
        while tier > Tier.AUTHORED:
            llm = self.models.get(tier)
            if llm is not None and id(llm) not in skip:
                breaker = self.breakers[id(llm)]
                if breaker.allow():
                    return tier, llm
                if probe is not None and breaker.take_probe():
                    self._send_probe(llm, breaker, probe)
            tier = tier.down()
        raise AllTiersDown(f"no model tier at or below {wanted.label} is available")

    def _send_probe(self, llm: ChatLLM, breaker: CircuitBreaker, probe: Probe) -> None:
        """The call asked for one token, in a task of its own whose usage is nobody's turn's:
        it only tells the breaker whether the endpoint answers within `slow_s` again."""
        messages, kw = probe

        async def run() -> None:
            deltas = llm.stream(messages, **{**kw, "max_tokens": 1})
            try:
                await asyncio.wait_for(anext(deltas), self.breaker_config.slow_s)
                failed = False
            except StopAsyncIteration:
                failed = False
            except Exception as e:  # TimeoutError included
                failed = endpoint_failed(e)
            finally:
                await deltas.aclose()  # type: ignore[attr-defined]
            log.info("tutor model %s probed: %s", llm.name, "down" if failed else "back")
            breaker.record(failed=failed)

        self._on_the_side(run())

    def _on_the_side(self, work: Coroutine[Any, Any, None]) -> None:
        """Runs `work` in a task of its own, whose usage is nobody's turn's."""
        task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    def model_name(self, wanted: Tier) -> str:
        """The model a call at `wanted` would go to now (for a reply-cache lookup), or the
        wanted tier's own when every breaker is open: a cached reply serves even then."""
        tier = wanted
        while tier > Tier.AUTHORED:
            llm = self.models.get(tier)
            if llm is not None and self.breakers[id(llm)].allow():
                return llm.name
            tier = tier.down()
        return (self.models.get(wanted) or next(iter(self.models.values()))).name

    async def complete(self, wanted: Tier, messages: Messages, **kw: Any) -> str:
        return "".join([d async for d in self.stream(wanted, messages, **kw)])

    async def stream(self, wanted: Tier, messages: Messages, **kw: Any) -> AsyncIterator[str]:
        """The reply's deltas from the first tier that answers. A model that fails, or sends no
        first token within the breaker's `slow_s`, is counted against its breaker and the next
        tier down is asked, within the same call; one that is merely late is hedged (below).
        Once text has flowed, a failure is the caller's (the student has seen it)."""
        tried: set[int] = set()
        while True:
            tier, llm = self.serving(wanted, frozenset(tried), (messages, kw))
            tried.add(id(llm))
            winner, first = await self._race(Attempt(tier, llm, messages, kw), tried, messages, kw)
            if winner is None:
                wanted = tier.down()  # every model tried was late or down
                continue
            if winner.call is not None:
                winner.call.answered = True
            breaker = self.breakers[id(winner.llm)]
            try:
                if first:
                    yield first
                async for delta in winner.rest():
                    yield delta
                breaker.record(failed=False)
                return
            except GeneratorExit:
                breaker.record(failed=False)  # the caller stopped reading: the model answered
                raise
            except Exception as e:
                # A request error (a 4xx, a prompt too long) counts as the endpoint answering.
                breaker.record(failed=endpoint_failed(e))
                raise
            finally:
                await winner.close()

    async def _race(
        self, primary: Attempt, tried: set[int], messages: Messages, kw: dict[str, Any]
    ) -> tuple[Attempt | None, str]:
        """The attempt whose first delta comes first, and that delta ("" for an empty reply);
        (None, "") when each attempt failed or sent nothing within `slow_s`, each counted
        against its breaker. Once `primary` is later than its endpoint's usual first token, the
        call is also sent a tier down (a hedge); a primary that loses to its hedge is watched on
        the side."""
        slow_s = self.breaker_config.slow_s
        latency = self.latency.get(id(primary.llm))
        hedge_at = primary.started + latency.hedge_after() if latency else float("inf")
        running = {primary.first_task: primary}

        async def drop(attempt: Attempt, failed: bool, abandoned: bool = False) -> None:
            del running[attempt.first_task]
            if abandoned:
                attempt.abandon()
            if failed:
                self.breakers[id(attempt.llm)].record(failed=True)
            await attempt.close()

        try:
            while running:
                deadline = min(a.started for a in running.values()) + slow_s
                if hedge_at < deadline and len(running) == 1:
                    deadline = hedge_at
                done, _ = await asyncio.wait(
                    running, timeout=max(0.0, deadline - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )  # fmt: skip
                for task in done:
                    attempt = running[task]
                    if (e := task.exception()) is None:
                        if t := self.latency.get(id(attempt.llm)):
                            t.observe(time.monotonic() - attempt.started)
                        del running[task]
                        if running.pop(primary.first_task, None) is not None:
                            self._watch(primary)
                        return attempt, task.result() or ""
                    if not endpoint_failed(e):
                        await drop(attempt, failed=False)
                        raise e
                    log.warning("tutor model %s failed (%s)", attempt.llm.name, e)
                    await drop(attempt, failed=True)
                now = time.monotonic()
                for attempt in [a for a in running.values() if now - a.started >= slow_s]:
                    log.warning("tutor model %s sent no token within %ss", attempt.llm.name, slow_s)
                    await drop(attempt, failed=True)
                if now >= hedge_at and list(running.values()) == [primary]:
                    hedge_at = float("inf")
                    if (hedge := self._hedge(primary, tried, messages, kw)) is not None:
                        running[hedge.first_task] = hedge
            return None, ""
        finally:
            for attempt in list(running.values()):  # a hedge that lost, or the caller gave up
                await drop(attempt, failed=False, abandoned=True)

    def _watch(self, late: Attempt) -> None:
        """A call that lost to its hedge is abandoned but watched on the side until its first
        token or `slow_s`, then aborted: only a model that is down, not one that is merely
        slower than the tier below, counts against its breaker, and the wait it took is one of
        its first-token latencies."""
        latency = self.latency[id(late.llm)]
        latency.hedges_won += 1
        late.abandon()

        async def run() -> None:
            try:
                await asyncio.wait_for(
                    asyncio.shield(late.first_task),
                    late.started + self.breaker_config.slow_s - time.monotonic(),
                )
                failed = False
                latency.observe(time.monotonic() - late.started)
            except Exception as e:  # TimeoutError included
                failed = endpoint_failed(e)
            finally:
                await late.close()
            self.breakers[id(late.llm)].record(failed=failed)

        self._on_the_side(run())

    def _hedge(
        self, primary: Attempt, tried: set[int], messages: Messages, kw: dict[str, Any]
    ) -> Attempt | None:
        """The same call a tier below `primary`, if a model there is available."""
        try:
            tier, llm = self.serving(primary.tier.down(), frozenset(tried))
        except AllTiersDown:
            return None
        tried.add(id(llm))
        self.latency[id(primary.llm)].hedged += 1
        log.info("tutor model %s is late; hedging on %s", primary.llm.name, llm.name)
        return Attempt(tier, llm, messages, kw)

    def describe(self) -> str:
        """Which model writes each tier, for the start-up log."""
        return ", ".join(f"{t.label} {self.models[t].name}" for t in (Tier.SMALL, Tier.LARGE))

    def health(self) -> dict[str, Any]:
        """Each model endpoint's breaker and hedged calls, for /health."""
        out: dict[str, Any] = {}
        for tier in (Tier.LARGE, Tier.SMALL):
            llm = self.models.get(tier)
            if llm is not None:
                entry = out.setdefault(llm.name, {"tiers": [], **self.breakers[id(llm)].snapshot()})
                entry["tiers"].append(tier.label)
                if t := self.latency.get(id(llm)):
                    entry.update(hedged=t.hedged, hedges_won=t.hedges_won)
        return out
