"""Tutoring at district scale, with scripted models: the reply cache keyed by pedagogy, the
tiering policy, circuit breakers against a failing endpoint, quotas per school, and costs that
add up. (The engine-backed checks are in test_tutor_scale_engine.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import fields, replace

import httpx
import pytest

from tutorkit import CountingLLM, ScriptedLLM
from tutorserve.tutor.breaker import BreakerConfig, CircuitBreaker, State
from tutorserve.tutor.courses import Course, load_courses
from tutorserve.tutor.llm_client import OpenAILLM
from tutorserve.tutor.quotas import Limits, OverQuota, QuotaExceeded, Quotas
from tutorserve.tutor.reply_cache import CachedReply, ReplyCache, ReplyKey
from tutorserve.tutor.routing import Routing
from tutorserve.tutor.service import TutorService
from tutorserve.tutor.store import TutorStore
from tutorserve.tutor.tiers import LearnerState, Situation, Tier, Uniform

KNOWN_MISTAKE = "x = 1 or x = 6"  # an authored misconception of algebra's first problem


@pytest.fixture(scope="module")
def algebra() -> Course:
    return load_courses()["algebra"]


@pytest.fixture
def store(tmp_path) -> Iterator[TutorStore]:
    s = TutorStore(f"sqlite:///{tmp_path}/tutor.db")
    yield s
    s.close()


def final(events: list[dict]) -> dict:
    (f,) = [e for e in events if e["event"] == "final"]
    return f


async def turns(service: TutorService, learner: str, messages: list[str], **kw) -> list[dict]:
    s = await service.start_session(learner, "algebra", **kw)
    return [final([e async for e in await service.start_turn(s["id"], m)]) for m in messages]


def calls_to(llm: ScriptedLLM, agent: str) -> int:
    return sum(a == agent for a, _ in llm.calls)


# ---- the reply cache ----------------------------------------------------------------------------
def test_changing_any_key_field_misses():
    cache = ReplyCache()
    key = ReplyKey("explain", "algebra", "v1", "factor-1", "factoring", 1, "careless", "B1", "m")
    cache.put(key, CachedReply("Look at the constant term.", 120))
    assert cache.get(key) == CachedReply("Look at the constant term.", 120)
    for f in fields(ReplyKey):
        value = getattr(key, f.name)
        other = replace(key, **{f.name: value + 1 if isinstance(value, int) else value + "x"})
        assert cache.get(other) is None, f"{f.name} is not part of the key"
    assert cache.stats()["saved_tokens"] == {"explain": 120}


def test_a_second_learner_with_the_same_mistake_is_served_from_the_cache(algebra, store):
    llm = CountingLLM()
    cache = ReplyCache()
    service = TutorService({"algebra": algebra}, store, Routing.single(llm, cache=cache))

    async def go():
        return [(await turns(service, learner, [KNOWN_MISTAKE]))[0] for learner in ("ana", "ben")]

    first, second = asyncio.run(go())
    assert calls_to(llm, "explain") == 1
    assert second["reply"] == first["reply"] and second["ladder_level"] == first["ladder_level"]
    assert first["tiers"]["explain"] == "large" and second["tiers"]["explain"] == "cache"
    assert second["usage"]["cached_replies"] == 1
    assert (
        second["usage"]["saved_tokens"]
        == first["usage"]["prompt_tokens"] + first["usage"]["generated_tokens"]
    )  # diagnose was authored: explain was the only model call of the first turn


def test_a_class_asking_at_once_costs_one_model_call_per_reply(algebra, store):
    """Single flight: eight learners send the same unforeseen wrong answer together; the model
    diagnoses it and writes the hint once, and the others wait for those replies."""
    llm = CountingLLM(delay={"diagnose": 0.02, "explain": 0.02})
    cache = ReplyCache()
    service = TutorService({"algebra": algebra}, store, Routing.single(llm, cache=cache))

    async def go():
        return await asyncio.gather(*(turns(service, f"kid{i}", ["x = 7"]) for i in range(8)))

    finals = [f for (f,) in asyncio.run(go())]
    assert calls_to(llm, "diagnose") == 1 and calls_to(llm, "explain") == 1
    assert len({f["reply"] for f in finals}) == 1
    assert sorted(f["tiers"]["explain"] for f in finals) == ["cache"] * 7 + ["large"]
    assert cache.stats()["hits"] == {"diagnose": 7, "explain": 7}


def test_a_failed_writer_lets_the_next_waiter_write(algebra, store):
    """The first call's model fails, so it caches nothing: a waiting learner writes the reply
    itself rather than waiting for good."""

    def explain(messages, attempt):
        if attempt == 0:
            raise ValueError("the model returned an empty reply")
        return "Think about which two numbers multiply to 6."

    llm = CountingLLM(script={"explain": explain}, delay={"explain": 0.02})
    service = TutorService({"algebra": algebra}, store, Routing.single(llm, cache=ReplyCache()))

    async def go():
        return await asyncio.gather(*(turns(service, f"kid{i}", ["x = 7"]) for i in range(3)))

    finals = [f for (f,) in asyncio.run(go())]
    assert calls_to(llm, "explain") == 2
    assert sorted(f["tiers"]["explain"] for f in finals) == ["authored", "cache", "large"]


def test_a_class_waiting_on_a_writer_moved_down_a_tier_takes_its_reply(algebra, store):
    """The large model hangs and its breaker has not opened yet: the one call writing each
    reply waits `slow_s` and is answered by the small model; the rest of the class takes that
    reply instead of each waiting on the hanging model in turn."""
    hits = []

    async def endpoint(request: httpx.Request) -> httpx.Response:
        hits.append(request.url.path)
        await asyncio.sleep(30)
        return httpx.Response(500)

    client = httpx.AsyncClient(transport=httpx.MockTransport(endpoint))
    large = OpenAILLM("http://stub/v1", "large-stub", http_client=client)
    small = CountingLLM("small")
    # A learner whose turn reaches the cache only after the writer moved down a tier asks the
    # large model itself (its breaker is still closed): `slow_s` leaves a loaded host's session
    # store a second to let the whole class in while the writer waits.
    slow_s = 1.0
    config = BreakerConfig(min_calls=20, slow_s=slow_s)  # stays closed throughout
    routing = Routing({Tier.SMALL: small, Tier.LARGE: large}, Uniform(Tier.LARGE), config,
                      ReplyCache())  # fmt: skip
    service = TutorService({"algebra": algebra}, store, routing)

    async def turn(session: dict) -> dict:
        return final([e async for e in await service.start_turn(session["id"], "x = 7")])

    async def go():
        sessions = [await service.start_session(f"kid{i}", "algebra") for i in range(8)]
        t0 = time.monotonic()
        finals = await asyncio.gather(*(turn(s) for s in sessions))
        return finals, time.monotonic() - t0

    finals, took = asyncio.run(go())
    # One hanging call per cached reply (diagnose, explain), not one per learner; engage's
    # sentence names the learner's own progress, so each learner's is asked for (at once).
    assert len(hits) == 2 + 8
    assert took < slow_s * 8, "the class waited on the hanging model one writer after another"
    assert sorted(f["tiers"]["explain"] for f in finals) == ["cache"] * 7 + ["small"]
    assert len({f["reply"] for f in finals}) == 1 and calls_to(small, "explain") == 1


def test_a_course_edit_invalidates_its_entries(algebra, store):
    llm, cache = CountingLLM(), ReplyCache()
    service = TutorService({"algebra": algebra}, store, Routing.single(llm, cache=cache))
    asyncio.run(turns(service, "ana", [KNOWN_MISTAKE]))
    assert len(cache) == 1
    edited = Course.model_validate(
        {**algebra.model_dump(), "persona": algebra.persona + " Be brief."}
    )
    service = TutorService({"algebra": edited}, store, Routing.single(llm, cache=cache))
    asyncio.run(turns(service, "ben", [KNOWN_MISTAKE]))
    assert calls_to(llm, "explain") == 2, "the edited course was served a reply of the old one"
    assert len(cache) == 1, "the old version's entry is still held"


def test_no_learner_derived_text_reaches_another_learner(algebra, store):
    private = "x = 17 because my dog Rex said so"

    def diagnose(messages, i):
        said = messages[-1]["content"].split("Student's answer: ")[1].split("\n")[0]
        return json.dumps({"label": "careless", "reason": f"wrote {said}"})

    llm = CountingLLM(script={"diagnose": diagnose})
    service = TutorService({"algebra": algebra}, store, Routing.single(llm, cache=ReplyCache()))

    async def go():
        a = await turns(service, "ana", [private])
        b = await turns(service, "ben", ["x = 9"])
        c = await turns(service, "cleo", [private])
        return a[0], b[0], c[0]

    a, b, c = asyncio.run(go())
    assert "Rex" in a["diagnosis"]["reason"]  # the learner's own diagnosis may quote them
    assert "Rex" not in json.dumps(b), "ben was shown text derived from ana's words"
    explain_prompts = json.dumps([m for agent, m in llm.calls if agent == "explain"])
    assert "Rex" not in explain_prompts, "a cacheable prompt carried a learner's words"
    assert b["tiers"]["explain"] == "cache"  # same problem, rung and label: shared
    # The same answer typed by another learner is the one case the key allows (its `said`).
    assert calls_to(llm, "diagnose") == 2 and c["tiers"]["diagnose"] == "cache"


# ---- tiering ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("agent", "rung", "mastery", "errors", "cefr", "tier"),
    [
        ("retrieve", 1, 0.2, 1, "", Tier.AUTHORED),
        ("diagnose", 1, 0.2, 1, "", Tier.SMALL),
        ("explain", 0, 0.5, 0, "", Tier.SMALL),
        ("explain", 1, 0.2, 1, "", Tier.LARGE),
        ("explain", 1, 0.8, 1, "", Tier.SMALL),  # a slip by a learner who masters the KC
        ("explain", 1, 0.8, 1, "A2", Tier.LARGE),  # ... but a beginner's language course
        ("explain", 2, 0.8, 2, "B1", Tier.LARGE),
        ("explain", 3, 0.1, 3, "", Tier.LARGE),
        ("explain", 3, 0.1, 4, "", Tier.AUTHORED),  # stuck: the author's worked correction
        ("engage", 0, 0.6, 0, "", Tier.SMALL),
        ("engage", 1, 0.3, 1, "", Tier.AUTHORED),
    ],
)  # fmt: skip
def test_the_default_tiering_policy(agent, rung, mastery, errors, cefr, tier):
    assert LearnerState().tier(Situation(agent, rung, mastery, errors, cefr)) is tier


def test_each_turn_records_the_tier_that_wrote_each_agents_text(algebra, store):
    small, large = CountingLLM("small"), CountingLLM("large")
    routing = Routing({Tier.SMALL: small, Tier.LARGE: large}, LearnerState())
    service = TutorService({"algebra": algebra}, store, routing)
    wrong, right = asyncio.run(turns(service, "ana", ["x = 7", "x = 2 or x = 3"]))
    assert wrong["tiers"] == {"diagnose": "small", "retrieve": "code", "explain": "large",
                              "assess": "code"}  # fmt: skip
    assert right["tiers"]["explain"] == "small"
    assert calls_to(large, "explain") == 1 and calls_to(small, "explain") == 1
    assert calls_to(small, "engage") == 1 and calls_to(large, "engage") == 0  # wrong: authored
    stored = store.turns(store.sessions_of("ana")[0].id)
    assert stored[0].timing["tiers"]["explain"] == "large"


# ---- circuit breakers ---------------------------------------------------------------------------
def test_breaker_opens_on_failures_then_probes_half_open():
    now = [0.0]
    b = CircuitBreaker(BreakerConfig(min_calls=3, failure_rate=0.5, open_s=10), lambda: now[0])
    for failed in (False, True, True):
        assert b.allow()
        b.record(failed)
    assert b.state is State.OPEN and not b.allow() and not b.take_probe()
    now[0] = 10.5
    assert not b.allow(), "a half-open endpoint gets no student's call"
    assert b.take_probe() and not b.take_probe(), "half-open sends exactly one probe"
    b.record(failed=True)
    assert b.state is State.OPEN
    now[0] = 21.0
    assert b.take_probe()
    b.record(failed=False)
    assert b.state is State.CLOSED and b.allow() and b.opened == 2


def test_a_half_open_endpoint_is_probed_on_the_side_and_rejoins_once_it_answers(algebra, store):
    """While the large model hangs, no student's call goes to it once its breaker opened: a
    half-open breaker is probed by a call of its own. Once a probe is answered, the large tier
    writes again."""
    hang = {"diagnose": 5.0, "explain": 5.0}
    large = CountingLLM("large", delay=hang)
    config = BreakerConfig(min_calls=1, failure_rate=1.0, slow_s=0.3, open_s=0.2)
    routing = Routing({Tier.SMALL: CountingLLM("small"), Tier.LARGE: large},
                      Uniform(Tier.LARGE), config)  # fmt: skip
    service = TutorService({"algebra": algebra}, store, routing)

    async def go():
        out = [(await turns(service, "first", ["x = 7"]))[0]]  # its diagnose opens the breaker
        await asyncio.sleep(0.25)  # half-open now
        out.append((await turns(service, "during", ["x = 7"]))[0])  # sends the probe
        await asyncio.sleep(0.4)  # the probe timed out: open again
        sent = (calls_to(large, "diagnose"), calls_to(large, "explain"))
        large.delay = {}  # it recovers
        await asyncio.sleep(0.25)  # half-open again
        await turns(service, "probing", ["x = 7"])  # its probe is answered
        await asyncio.sleep(0.05)
        out.append((await turns(service, "after", ["x = 7"]))[0])
        return out, sent

    (first, during, after), sent = asyncio.run(go())
    for f in (first, during):
        assert (f["tiers"]["diagnose"], f["tiers"]["explain"]) == ("small", "small"), f["tiers"]
    assert sent == (2, 0), "besides the call that opened it, the large model got only the probe"
    assert (after["tiers"]["diagnose"], after["tiers"]["explain"]) == ("large", "large")
    assert routing.health()["large"]["state"] == "closed"


@pytest.mark.parametrize("failure", ["errors", "hangs"])
def test_a_failing_large_endpoint_opens_its_breaker_and_turns_finish_on_the_small_one(
    algebra, store, failure
):
    hits = []

    async def endpoint(request: httpx.Request) -> httpx.Response:
        hits.append(request.url.path)
        if failure == "hangs":
            await asyncio.sleep(30)
        return httpx.Response(500, json={"error": {"message": "model crashed"}})

    client = httpx.AsyncClient(transport=httpx.MockTransport(endpoint))
    large = OpenAILLM("http://stub/v1", "large-stub", http_client=client)
    small = CountingLLM("small")
    # A call waiting on the endpoint takes `slow_s`; a turn's own work (the session store's
    # writes included, slow on a loaded host) takes well under it.
    slow_s = 1.0
    config = BreakerConfig(min_calls=2, failure_rate=0.5, slow_s=slow_s, open_s=60)
    routing = Routing({Tier.SMALL: small, Tier.LARGE: large}, Uniform(Tier.LARGE), config)
    service = TutorService({"algebra": algebra}, store, routing)

    async def go():
        out = []
        for i in range(4):
            t0 = time.monotonic()
            f = (await turns(service, f"l{i}", ["x = 7"]))[0]
            out.append((f, time.monotonic() - t0))
        return out

    done = asyncio.run(go())
    for f, took in done:
        assert f["tiers"]["explain"] == "small" and f["fallbacks"] == []
        assert took < 5.0, "a turn waited on the failing endpoint"
    assert service.health()["models"]["large-stub"]["state"] == "open"
    before = len(hits)
    assert before <= 4, "calls kept going to the failing endpoint"  # 2 calls x a retry each
    assert all(took < slow_s for _, took in done[2:]), "no time is lost once the breaker is open"


# ---- quotas ---------------------------------------------------------------------------------
def test_a_school_over_its_turn_quota_is_refused_with_retry_after(algebra, store):
    now = [1000.0]
    quotas = Quotas({"north": Limits(turns_per_minute=2)}, clock=lambda: now[0])
    service = TutorService({"algebra": algebra}, store, CountingLLM(), quotas=quotas)

    async def go():
        s = await service.start_session("ana", "algebra", school="north")
        other = await service.start_session("ben", "algebra", school="south")
        for m in ("x = 7", "x = 8"):
            [e async for e in await service.start_turn(s["id"], m)]
        with pytest.raises(QuotaExceeded) as refused:
            await service.start_turn(s["id"], "x = 9")
        [e async for e in await service.start_turn(other["id"], "x = 9")]  # not north's quota
        now[0] += 61
        [e async for e in await service.start_turn(s["id"], "x = 9")]  # a new minute
        return refused.value

    refused = asyncio.run(go())
    assert 1 <= refused.retry_after <= 60 and quotas.refused == 1


def test_a_degrading_quota_serves_authored_text_without_any_model_call(algebra, store):
    llm = CountingLLM()
    quotas = Quotas({}, default=Limits(tokens_per_minute=1, over=OverQuota.DEGRADE))
    service = TutorService({"algebra": algebra}, store, llm, quotas=quotas)
    first, second = asyncio.run(turns(service, "ana", ["x = 7", "x = 8"]))
    assert first["tiers"]["explain"] == "large"  # the first turn spent the minute's tokens
    calls = len(llm.calls)
    assert second["tiers"] == {"diagnose": "authored", "retrieve": "code",
                               "explain": "authored", "assess": "code"}  # fmt: skip
    assert second["ladder_level"] == 2 and second["fallbacks"] == []
    assert second["reply"] == "Not quite. " + load_courses()["algebra"].problems[0].hints[1]
    assert len(llm.calls) == calls and quotas.degraded == 1


# ---- costs ----------------------------------------------------------------------------------
def test_costs_add_up_across_store_ledger_and_what_the_model_reported(algebra, store):
    reported = []

    class Recording(CountingLLM):
        async def stream(self, messages, **kw):
            prompt = sum(len(m["content"].split()) for m in messages)
            words = [w async for w in super().stream(messages, **kw)]
            reported.append((prompt, len(words)))
            for w in words:
                yield w

    service = TutorService({"algebra": algebra}, store, Recording())

    async def go():
        await turns(service, "ana", ["x = 7", "x = 9", "x = 2 or x = 3"], school="north")
        await turns(service, "ben", ["x = 5"], school="south")
        await asyncio.sleep(0.05)  # engage is charged after the final event

    asyncio.run(go())
    prompt, generated = sum(p for p, _ in reported), sum(g for _, g in reported)
    for by in ("school", "course", "agent", "model", "learner", "session"):
        totals = service.usage.totals(by)
        assert sum(t.prompt_tokens for t in totals) == prompt, by
        assert sum(t.generated_tokens for t in totals) == generated, by
    schools = {t.key: t for t in service.usage.totals("school")}
    assert set(schools) == {"north", "south"} and schools["north"].calls > schools["south"].calls
    ledger = service.ledger.snapshot()
    assert sum(n for k, n in ledger["tokens"].items() if k[0] == "prompt") == prompt
    assert sum(n for k, n in ledger["turns"].items()) == 4


def test_tutor_costs_prints_a_table_and_a_plot_by_school(algebra, tmp_path, capsys):
    from tutorserve.cli import main

    url = f"sqlite:///{tmp_path}/costs.db"
    store = TutorStore(url)
    service = TutorService({"algebra": algebra}, store, CountingLLM())
    asyncio.run(turns(service, "ana", ["x = 7"], school="north"))
    asyncio.run(turns(service, "ben", ["x = 7", "x = 8"], school="south"))
    store.close()
    png = tmp_path / "costs.png"
    assert main(["tutor", "costs", "--by", "school", "--tutor-db", url, "--out", str(png)]) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| *"): line for line in out.splitlines()}
    assert {"north", "south", "total"} <= set(rows)
    calls = {k: int(rows[k].split(" | ")[1]) for k in ("north", "south", "total")}
    assert calls["north"] + calls["south"] == calls["total"] and calls["south"] > calls["north"]
    assert png.stat().st_size > 1000


# ---- over HTTP: 429 with Retry-After, breakers in /health, costs in /metrics -------------------
def test_the_api_refuses_an_over_quota_school_with_429_and_shows_breakers_and_costs(algebra, store):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tutorserve.server.tutor_api import tutor_router
    from tutorserve.server.tutor_metrics import TutorCollector

    quotas = Quotas({"north": Limits(turns_per_day=1)})
    routing = Routing.single(CountingLLM(), cache=ReplyCache())
    service = TutorService({"algebra": algebra}, store, routing, quotas=quotas)
    app = FastAPI()
    app.include_router(tutor_router(service))
    with TestClient(app) as client:
        urls = []
        for learner, school in (("ana", "north"), ("ben", "south")):
            body = {"learner_id": learner, "course": "algebra", "school": school}
            s = client.post("/v1/tutor/sessions", json=body)
            urls.append(f"/v1/tutor/sessions/{s.json()['id']}/turns")
            assert "event: final" in client.post(urls[-1], json={"message": KNOWN_MISTAKE}).text
        refused = client.post(urls[0], json={"message": "x = 8"})
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    err = refused.json()["error"]
    assert err["code"] == "quota_exceeded" and "north" in err["message"]

    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(TutorCollector(service))
    text = generate_latest(registry).decode()
    assert 'tutorserve:tutor_tokens_total{agent="explain",course="algebra",kind="prompt"' in text
    assert (
        'school="north"' in text
        and 'tutorserve:tutor_quota_exceeded_total{action="refused"} 1.0' in text
    )
    assert 'tutorserve:tutor_breaker_open{model="scripted"} 0.0' in text
    assert 'tutorserve:tutor_reply_cache_hits_total{agent="explain"} 1.0' in text
    assert 'tutorserve:tutor_reply_cache_saved_tokens_total{agent="explain"}' in text


def test_each_agent_span_carries_its_tokens_and_tier(algebra, store):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    service = TutorService(
        {"algebra": algebra}, store, CountingLLM(), tracer=provider.get_tracer("test")
    )
    (f,) = asyncio.run(turns(service, "ana", ["x = 7"]))
    spans = {s.name: s.attributes for s in exporter.get_finished_spans()}
    explain = spans["tutor.explain"]
    assert explain["tutor.tokens.prompt"] > 0 and explain["tutor.tiers"] == "large"
    assert spans["tutor.retrieve"]["tutor.tokens.prompt"] == 0
    prompt = sum(a.get("tutor.tokens.prompt", 0) for n, a in spans.items() if n != "tutor.engage")
    assert prompt == f["usage"]["prompt_tokens"]


def test_a_bad_request_is_not_held_against_the_endpoint():
    async def go():
        class TooLong(CountingLLM):
            async def stream(self, messages, **kw):
                raise ValueError("tutor prompt of 9000 tokens leaves no room to answer")
                yield ""

        routing = Routing.single(TooLong(), breaker=BreakerConfig(min_calls=1))
        for _ in range(3):
            with pytest.raises(ValueError):
                await routing.complete(Tier.LARGE, [{"role": "user", "content": "hi"}],
                                       max_tokens=8)  # fmt: skip
        return routing.health()["scripted"]

    health = asyncio.run(go())
    assert health["state"] == "closed" and health["failures_in_window"] == 0


def test_an_exam_week_school_s_model_calls_go_first(algebra, store):
    llm = CountingLLM()
    quotas = Quotas({"exam-week": Limits(priority=-1)})
    service = TutorService({"algebra": algebra}, store, llm, quotas=quotas)
    asyncio.run(turns(service, "ana", ["x = 7"], school="exam-week"))
    asyncio.run(turns(service, "ben", ["x = 7"], school="other"))
    calls = len(llm.priorities) // 2
    assert llm.priorities[:calls] == [-1] * calls and llm.priorities[calls:] == [0] * calls
