"""The turn pipeline with a scripted model: DAG order and parallelism, timeouts and fallbacks,
the Socratic ladder and the answer-leak guard (on MathDial problems), the learner model updates,
and one OpenTelemetry span per agent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tutorkit import ScriptedLLM, mathdial_answer, mathdial_course, mathdial_rows
from tutorserve.tutor.answers import leaks_answer
from tutorserve.tutor.courses import Course
from tutorserve.tutor.service import SessionBusyError, TutorService
from tutorserve.tutor.store import TutorStore

WRONG = "Not quite. "  # the verdict the code puts before every reply to a wrong answer


@pytest.fixture(scope="module")
def course() -> Course:
    return mathdial_course(20)


@pytest.fixture
def store(tmp_path) -> Iterator[TutorStore]:
    s = TutorStore(f"sqlite:///{tmp_path}/tutor.db")
    yield s
    s.close()


def run(coro):
    return asyncio.run(coro)


async def _turn(service: TutorService, session_id: str, message: str) -> list[dict]:
    return [e async for e in await service.start_turn(session_id, message)]


async def _session(service: TutorService, learner: str = "ana") -> dict:
    return await service.start_session(learner, "mathdial")


def _visible(events: list[dict]) -> str:
    """What the student ends up seeing: the deltas after the last reset."""
    text = ""
    for e in events:
        if e["event"] == "reset":
            text = ""
        elif e["event"] == "delta":
            text += e["text"]
    return text


def _final(events: list[dict]) -> dict:
    (final,) = [e for e in events if e["event"] == "final"]
    return final


def test_diagnose_and_retrieve_run_in_parallel_and_explain_waits_for_both(course, store):
    def slow_retrieve(turn):
        time.sleep(0.6)  # a slow retriever (say, a vector search) in its worker thread
        return ["notes"]

    llm = ScriptedLLM(delay={"diagnose": 0.05, "explain": 0.02})
    service = TutorService({"mathdial": course}, store, llm, retriever=slow_retrieve)

    async def go():
        s = await _session(service)
        return await _turn(service, s["id"], "The answer is 4")

    events = run(go())
    steps = _final(events)["timing"]["steps"]
    # diagnose did not wait for retrieve: both started at once, diagnose finished long before.
    assert steps["diagnose"]["start_ms"] < 100 and steps["retrieve"]["start_ms"] < 100
    assert steps["diagnose"]["end_ms"] < steps["retrieve"]["end_ms"] - 300
    # explain waited for both; assess for explain; engage came after the final event.
    assert steps["explain"]["start_ms"] >= steps["retrieve"]["end_ms"]
    assert steps["assess"]["start_ms"] >= steps["explain"]["end_ms"]
    names = [e["event"] for e in events]
    assert names.index("final") < names.index("engage") == len(names) - 1
    timing = _final(events)["timing"]
    assert timing["critical_path_ms"] < timing["sum_of_steps_ms"]
    # explain saw the retrieved notes.
    explain_prompt = next(m for a, m in llm.calls if a == "explain")[-1]["content"]
    assert "notes" in explain_prompt


def test_a_timed_out_node_falls_back_and_the_turn_completes(course, store):
    llm = ScriptedLLM(delay={"diagnose": 2.0, "explain": 2.0})
    service = TutorService(
        {"mathdial": course}, store, llm,
        timeouts={"diagnose": 0.2, "retrieve": 0.2, "explain": 0.3},
        retriever=lambda turn: time.sleep(1.0) or ["late"],
    )  # fmt: skip

    async def go():
        s = await _session(service)
        t0 = time.monotonic()
        events = await _turn(service, s["id"], "I got 4")
        return events, time.monotonic() - t0, s

    events, elapsed, s = run(go())
    final = _final(events)
    assert set(final["fallbacks"]) >= {"diagnose", "retrieve", "explain"}
    assert elapsed < 2.0, "a slow node stalled the turn"
    # The code part of the diagnosis survives the fallback; the reply is the authored hint.
    problem = course.problem[s["problem"]["id"]]
    assert final["diagnosis"]["correct"] is False and final["ladder_level"] == 1
    assert final["reply"] == WRONG + problem.hints[0] == _visible(events)
    assert llm.abandoned >= 2  # the slow generations were cancelled, not left running


def test_ladder_climbs_with_repeated_errors_and_resets_on_a_right_answer(course, store):
    service = TutorService({"mathdial": course}, store, ScriptedLLM())

    async def go():
        s = await _session(service)
        answer = course.problem[s["problem"]["id"]].answer
        wrong = str(int(answer.replace(",", "")) + 7)
        out = [await _turn(service, s["id"], f"I think it is {wrong}") for _ in range(3)]
        out.append(await _turn(service, s["id"], "Can you help me?"))
        out.append(await _turn(service, s["id"], f"It is {answer}"))
        return s, out

    s, turns = run(go())
    finals = [_final(t) for t in turns]
    assert [f["ladder_level"] for f in finals] == [1, 2, 3, 3, 0]
    assert [f["ladder"] for f in finals[:3]] == ["hint", "guiding question", "correction"]
    p = [f["mastery_changes"].get("word-problems") for f in finals]
    assert p[0]["after"] < p[0]["before"] and p[1]["after"] < p[1]["before"]
    assert p[3] is None, "a help request is not an attempt"
    assert p[4]["after"] > p[4]["before"]
    assert finals[4]["diagnosis"]["correct"] is True
    assert finals[4]["reply"].startswith("Correct! ") and finals[0]["reply"].startswith(WRONG)
    assert not finals[3]["reply"].startswith((WRONG, "Correct")), "a question gets no verdict"
    assert finals[4]["next_problem"]["id"] != s["problem"]["id"]
    (kc,) = finals[4]["mastery"]
    assert kc["attempts"] == 4 and kc["errors"] == 3


@pytest.mark.parametrize("row", range(12))
def test_guard_keeps_the_answer_out_of_hints_and_questions(course, store, row):
    """The model leaks the MathDial answer every time: the guard resets the stream, retries once
    with a stricter prompt, then falls back to the authored hint; the answer never shows."""
    problem = course.problems[row]
    answer = problem.answer  # the MathDial ground truth's final line
    assert answer == mathdial_answer(
        next(r for r in mathdial_rows(30) if f"md{r['qid']}" == problem.id)
    )
    leaky = ScriptedLLM(
        script={"explain": lambda m, i: f"Good try! Let me help. The total is {answer} so check."}
    )
    service = TutorService({"mathdial": course}, store, leaky)

    async def go():
        s = await _session(service, learner=f"l{row}")
        await asyncio.to_thread(store.set_problem, s["id"], problem.id)
        return [await _turn(service, s["id"], "is it 0.5") for _ in range(2)]

    for level, events in zip((1, 2), run(go()), strict=True):
        final = _final(events)
        assert final["ladder_level"] == level
        shown = "".join(e["text"] for e in events if e["event"] == "delta")
        assert not leaks_answer(shown, problem), f"the answer reached the student: {shown!r}"
        assert _visible(events) == final["reply"] == WRONG + problem.hints[level - 1]
        assert [e["event"] for e in events].count("reset") >= 1
        assert "explain" in final["fallbacks"]
    assert sum(a == "explain" for a, _ in leaky.calls) == 4  # two tries per turn
    assert leaky.abandoned == 4  # each leaking generation was cut off


def test_guard_lets_a_clean_hint_through_and_a_correction_may_state_the_answer(course, store):
    problem = course.problems[0]
    answer = problem.answer
    llm = ScriptedLLM(
        script={
            "explain": lambda m, i: (
                f"Here is the working: the answer is {answer}."
                if "step by step" in m[-1]["content"]
                else (
                    "Start by listing what you know. What changed first?",
                    "Which one came first?",
                )[i % 2]
            )
        }
    )
    service = TutorService({"mathdial": course}, store, llm)

    async def go():
        s = await _session(service)
        return [await _turn(service, s["id"], "I got 0.25") for _ in range(3)]

    turns = run(go())
    assert _visible(turns[0]) == WRONG + "Start by listing what you know. What changed first?"
    assert "reset" not in [e["event"] for t in turns[:2] for e in t]
    assert _final(turns[2])["ladder_level"] == 3 and answer in _visible(turns[2])


def test_one_span_per_agent_under_the_turn_span(course, store):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    service = TutorService({"mathdial": course}, store, ScriptedLLM(), tracer=tracer)

    async def go():
        s = await _session(service)
        return await _turn(service, s["id"], "maybe 3")

    run(go())
    spans = exporter.get_finished_spans()
    names = sorted(s.name for s in spans)
    assert names == sorted(
        ["tutor.turn"] + [f"tutor.{n}" for n in ("diagnose", "retrieve", "explain", "assess")]
        + ["tutor.engage"]
    )  # fmt: skip
    (turn,) = [s for s in spans if s.name == "tutor.turn"]
    for s in spans:
        if s is not turn:
            assert s.parent is not None and s.parent.span_id == turn.context.span_id
            assert s.context.trace_id == turn.context.trace_id
    assert trace.get_tracer_provider() is not provider  # the global provider was left alone


def test_a_session_answers_one_turn_at_a_time_and_turns_are_stored(course, store):
    service = TutorService({"mathdial": course}, store, ScriptedLLM(delay={"explain": 0.05}))

    async def go():
        s = await _session(service)
        both = await asyncio.gather(
            service.start_turn(s["id"], "7?"),
            service.start_turn(s["id"], "8"),
            return_exceptions=True,
        )
        # Both were in flight together; whichever got there second is refused.
        refused = [r for r in both if isinstance(r, SessionBusyError)]
        (started,) = [r for r in both if not isinstance(r, BaseException)]
        assert len(refused) == 1
        with pytest.raises(KeyError):
            await service.start_turn("nope", "8")
        events = [e async for e in started]
        return events, await service.session(s["id"])

    events, stored = run(go())
    assert stored["turns"][0]["reply"] == _final(events)["reply"]
    assert stored["turns"][0]["engage"] == "You are improving."


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        ("Nice effort. The correct answer is x = 6, check it.", "states a (wrong) answer"),
        ("Let me see. So x = 41 would work here, try it.", "states a value of x"),
    ],
)
def test_below_the_correction_rung_no_answer_is_stated_even_a_wrong_one(course, store, reply, why):
    llm = ScriptedLLM(script={"explain": lambda m, i: reply})
    service = TutorService({"mathdial": course}, store, llm)

    async def go():
        s = await _session(service)
        return await _turn(service, s["id"], "I got 0.25")

    events = run(go())
    final = _final(events)
    assert final["reply"] == WRONG + course.problems[0].hints[0], why
    assert "=" not in "".join(e["text"] for e in events if e["event"] == "delta")


def test_a_guiding_question_that_asks_nothing_is_replaced_by_the_authored_one(course, store):
    llm = ScriptedLLM(script={"explain": lambda m, i: "Keep working on it. You can do this."})
    service = TutorService({"mathdial": course}, store, llm)

    async def go():
        s = await _session(service)
        return [await _turn(service, s["id"], "I got 0.25") for _ in range(2)]

    first, second = run(go())
    assert (
        _final(first)["reply"] == WRONG + "Keep working on it. You can do this."
    )  # a hint may state
    assert _final(second)["reply"] == WRONG + course.problems[0].hints[1]
    assert _visible(second) == WRONG + course.problems[0].hints[1]
    assert sum(a == "explain" for a, _ in llm.calls) == 2  # no regeneration for this one


def test_a_reply_copied_from_earlier_in_the_session_is_replaced(course, store):
    same = "Which two quantities do you know, and which one do you still need to work out?"
    service = TutorService(
        {"mathdial": course}, store, ScriptedLLM(script={"explain": lambda m, i: same})
    )

    async def go():
        s = await _session(service)
        return [await _turn(service, s["id"], "I got 0.25") for _ in range(2)]

    first, second = run(go())
    assert _final(first)["reply"] == WRONG + same
    assert _final(second)["reply"] == WRONG + course.problems[0].hints[1]


def test_a_reply_cut_off_by_the_token_limit_ends_at_its_last_whole_sentence(course, store):
    cut = "Well done. Each bracket is zero at one of the roots, and then the"
    service = TutorService(
        {"mathdial": course}, store, ScriptedLLM(script={"explain": lambda m, i: cut})
    )

    async def go():
        s = await _session(service)
        return await _turn(service, s["id"], f"It is {course.problems[0].answer}")

    assert _final(run(go()))["reply"] == "Correct! Well done."


def test_timeouts_name_agents_and_a_wrong_name_or_value_is_refused(course, store):
    with pytest.raises(ValueError, match="no agent named diagnosis"):
        TutorService({"mathdial": course}, store, ScriptedLLM(), timeouts={"diagnosis": 1.0})
    with pytest.raises(ValueError, match="positive seconds: explain"):
        TutorService({"mathdial": course}, store, ScriptedLLM(), timeouts={"explain": 0})
    service = TutorService({"mathdial": course}, store, ScriptedLLM(), timeouts={"engage": 5})
    assert service.timeouts["engage"] == 5 and service.timeouts["explain"] == 60.0
