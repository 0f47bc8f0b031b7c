"""Hedged tutor model calls: a call later than its model's usual first token is also sent a tier
down; the first model to answer writes, the other call is aborted, the tokens of both are
charged, and a model that keeps losing to its hedges opens its breaker."""

from __future__ import annotations

import asyncio
import time

import pytest

from tutorkit import CountingLLM
from tutorserve.tutor.breaker import BreakerConfig
from tutorserve.tutor.costs import answered_by, open_log
from tutorserve.tutor.courses import load_courses
from tutorserve.tutor.hedge import FirstTokenLatency, HedgeConfig
from tutorserve.tutor.routing import Routing
from tutorserve.tutor.service import TutorService
from tutorserve.tutor.settings import TutorSettings
from tutorserve.tutor.store import TutorStore
from tutorserve.tutor.tiers import Tier, Uniform

ASK = [{"role": "user", "content": "Explain the distributive law, please."}]


def tiers(small: CountingLLM, large: CountingLLM, **kw) -> Routing:
    kw.setdefault("breaker", BreakerConfig(slow_s=5.0))
    return Routing({Tier.SMALL: small, Tier.LARGE: large}, Uniform(Tier.LARGE), **kw)


async def call(routing: Routing) -> tuple[str, list, float]:
    log = open_log("explain")
    t0 = time.monotonic()
    text = await routing.complete(Tier.LARGE, ASK, max_tokens=16, temperature=0.0,
                                  session_id=None)  # fmt: skip
    return text, log.calls, time.monotonic() - t0


def test_a_late_model_is_hedged_a_tier_down_and_the_hedge_writes():
    small = CountingLLM("small", script={"explain": lambda m, i: "Multiply each term."})
    large = CountingLLM("large", delay={"explain": 0.6})
    routing = tiers(small, large, hedge=HedgeConfig(after_s=0.2))

    async def go():
        out = await call(routing)
        await asyncio.sleep(0.8)  # the late call's first token came on the side
        return out

    text, calls, took = asyncio.run(go())
    assert text == "Multiply each term." and took < 0.5, took
    assert [(c.model, c.answered) for c in calls] == [("large", False), ("small", True)]
    assert answered_by(calls) == "small"
    assert large.abandoned == 1, "the late call was aborted after its first token"
    # Both calls are charged: the abandoned one read its prompt too.
    assert all(c.prompt_tokens > 0 for c in calls) and calls[1].generated_tokens == 3
    assert calls[0].seconds < 0.5, "the abandoned call's time ends when it was abandoned"
    health = routing.health()
    assert (health["large"]["hedged"], health["large"]["hedges_won"]) == (1, 1)
    # Slower than the tier below is not down: its breaker counts it as answered.
    assert (health["large"]["calls_in_window"], health["large"]["failures_in_window"]) == (1, 0)
    assert routing.latency[id(large)]._seen == pytest.approx([0.6], abs=0.15)


def test_a_primary_that_answers_first_keeps_the_call_and_is_not_held_against_it():
    small = CountingLLM("small", delay={"explain": 2.0})
    large = CountingLLM("large", delay={"explain": 0.4})
    routing = tiers(small, large, hedge=HedgeConfig(after_s=0.1))
    text, calls, _ = asyncio.run(call(routing))
    assert text == "Think about it."
    assert [(c.model, c.answered) for c in calls] == [("large", True), ("small", False)]
    assert answered_by(calls) == "large" and small.abandoned == 1
    health = routing.health()
    assert (health["large"]["hedged"], health["large"]["hedges_won"]) == (1, 0)
    assert health["large"]["failures_in_window"] == 0


def test_without_a_hedge_config_a_late_model_is_waited_for():
    small, large = CountingLLM("small"), CountingLLM("large", delay={"explain": 0.4})
    _, calls, took = asyncio.run(call(tiers(small, large)))
    assert [c.model for c in calls] == ["large"] and took >= 0.4 * 3
    assert not small.calls


def test_a_hanging_model_opens_its_breaker_once_its_hedged_calls_miss_slow_s():
    small, large = CountingLLM("small"), CountingLLM("large", delay={"explain": 60.0})
    config = BreakerConfig(min_calls=2, failure_rate=0.5, slow_s=0.5, open_s=60)
    routing = tiers(small, large, breaker=config, hedge=HedgeConfig(after_s=0.1))

    async def go():
        hedged = [await call(routing) for _ in range(2)]
        await asyncio.sleep(0.5)  # both late calls pass slow_s on the side
        return hedged, await call(routing)

    hedged, after = asyncio.run(go())
    assert all(took < 0.4 for _, _, took in hedged), [took for _, _, took in hedged]
    assert len(large.calls) == 2 and large.abandoned == 2
    assert routing.health()["large"]["state"] == "open"
    assert [c.model for c in after[1]] == ["small"], "once open, no call waits for a hedge"


class Failing(CountingLLM):
    """Fails after `after` seconds, as an endpoint that errors would."""

    def __init__(self, name: str, after: float) -> None:
        super().__init__(name)
        self.after = after

    async def stream(self, messages, **kw):
        self.calls.append(("explain", messages))
        await asyncio.sleep(self.after)
        raise ConnectionError("the endpoint closed the connection")
        yield ""


def test_a_primary_that_fails_while_its_hedge_runs_leaves_the_call_to_the_hedge():
    small = CountingLLM("small", delay={"explain": 0.3})
    large = Failing("large", after=0.15)
    routing = tiers(small, large, hedge=HedgeConfig(after_s=0.05))
    text, calls, took = asyncio.run(call(routing))
    assert text == "Think about it." and took < 1.5
    assert [c.model for c in calls] == ["large", "small"] and answered_by(calls) == "small"
    assert routing.health()["large"]["failures_in_window"] == 1
    assert len(small.calls) == 1, "the hedge was not sent a second time"


def test_a_hedge_that_fails_leaves_the_call_waiting_for_the_primary():
    small = Failing("small", after=0.05)
    large = CountingLLM("large", delay={"explain": 0.3})
    routing = tiers(small, large, hedge=HedgeConfig(after_s=0.1))
    text, calls, _ = asyncio.run(call(routing))
    assert text == "Think about it." and answered_by(calls) == "large"
    health = routing.health()
    assert health["small"]["failures_in_window"] == 1
    assert (health["large"]["hedged"], health["large"]["hedges_won"]) == (1, 0)


def test_the_hedge_wait_is_learned_from_the_models_own_first_tokens():
    t = FirstTokenLatency(HedgeConfig(after_s=7.0, quantile=0.9, min_samples=10, window=20))
    for s in range(9):
        t.observe(s / 10)
    assert t.hedge_after() == 7.0, "too few first tokens on record: the configured wait"
    t.observe(0.9)
    assert t.hedge_after() == pytest.approx(0.9)
    for _ in range(20):
        t.observe(0.05)  # the window keeps the recent ones only
    assert t.hedge_after() == pytest.approx(0.05)


def test_one_model_for_every_tier_is_never_hedged_onto_itself():
    llm = CountingLLM("only", delay={"explain": 0.2})
    routing = Routing.single(llm, hedge=HedgeConfig(after_s=0.05))
    asyncio.run(call(routing))
    assert len(llm.calls) == 1 and "hedged" not in routing.health()["only"]


def test_a_turn_under_a_hanging_large_model_is_written_by_the_hedge(tmp_path):
    store = TutorStore(f"sqlite:///{tmp_path}/tutor.db")
    small, large = CountingLLM("small"), CountingLLM("large", delay={"diagnose": 60.0,
                                                                     "explain": 60.0})  # fmt: skip
    routing = tiers(small, large, hedge=HedgeConfig(after_s=0.1))
    service = TutorService({"algebra": load_courses()["algebra"]}, store, routing)

    async def go():
        s = await service.start_session("ana", "algebra")
        events = [e async for e in await service.start_turn(s["id"], "x = 7")]
        return next(e for e in events if e["event"] == "final")

    try:
        t0 = time.monotonic()
        final = asyncio.run(go())
        took = time.monotonic() - t0
    finally:
        store.close()
    assert final["tiers"]["explain"] == "small" and final["fallbacks"] == [], final
    assert took < 2.0, took
    assert final["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(
    "text, hedge",
    [("", HedgeConfig()), ("hedge: null\n", None), ("hedge: {after_s: 2}\n", HedgeConfig(2.0))],
)
def test_the_tutor_config_turns_hedging_on_by_default(tmp_path, text, hedge):
    path = tmp_path / "tutor.yaml"
    path.write_text("policy: uniform\n" + text)
    assert TutorSettings.load(path).hedge == hedge


@pytest.mark.parametrize("bad", ["{after_s: 0}", "{quantile: 1.5}", "{min_samples: 0}", "{x: 1}"])
def test_a_bad_hedge_section_is_refused_with_its_field(tmp_path, bad):
    path = tmp_path / "tutor.yaml"
    path.write_text(f"hedge: {bad}\n")
    with pytest.raises(ValueError, match="hedge"):
        TutorSettings.load(path)
