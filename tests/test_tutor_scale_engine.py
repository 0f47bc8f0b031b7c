"""The scale features on the real engine: tutor costs add up to the engine's own token counters,
and the diagnose agent's JSON, constrained by its schema, always carries a valid label even from
SmolLM2-135M sampled hot."""

from __future__ import annotations

import asyncio
import json

import pytest

from tutorserve.config import EngineConfig
from tutorserve.engine.async_engine import AsyncEngine
from tutorserve.engine.engine import LLMEngine
from tutorserve.engine.outputs import RequestOutput
from tutorserve.tutor.agents.diagnose import parse
from tutorserve.tutor.courses import load_courses
from tutorserve.tutor.llm_client import EngineLLM, complete
from tutorserve.tutor.prompts import DIAGNOSIS_SCHEMA, ERROR_LABELS, diagnose_messages
from tutorserve.tutor.service import TutorService
from tutorserve.tutor.store import TutorStore


def test_costs_add_up_to_the_engines_token_counters(synth_llama_long, tmp_path):
    config = EngineConfig.from_kwargs(model=synth_llama_long, dtype="float32")
    server = AsyncEngine(lambda: LLMEngine(config))
    finished: list[RequestOutput] = []
    server.on_finished = finished.append
    store = TutorStore(f"sqlite:///{tmp_path}/tutor.db")
    service = TutorService(load_courses(), store, EngineLLM(server, "tiny"))

    async def go():
        await server.start()
        try:
            # English gaps: a random model's bytes practically never contain the gap's word,
            # so no reply is cut off by the guard (an abandoned generation's last tokens are
            # counted by the engine after the tutor stopped reading).
            for learner, school, messages in (
                ("ana", "north", ["watched", "wented"]),
                ("ben", "south", ["watch", "I dunno"]),
            ):
                s = await service.start_session(learner, "english-b1", school=school)
                for m in messages:
                    events = [e async for e in await service.start_turn(s["id"], m)]
                    assert events[-1]["event"] == "engage"  # charged once engage is stored
        finally:
            await server.stop()

    asyncio.run(go())
    store.close()
    engine = {
        "prompt": sum(o.metrics.num_prompt_tokens for o in finished),
        "cached": sum(o.metrics.num_cached_tokens for o in finished),
        "generated": sum(o.metrics.num_output_tokens for o in finished),
    }
    assert engine["prompt"] > 1000 and engine["generated"] > 0
    for by in ("school", "course", "agent", "model"):
        totals = service.usage.totals(by)
        ours = {
            "prompt": sum(t.prompt_tokens for t in totals),
            "cached": sum(t.cached_tokens for t in totals),
            "generated": sum(t.generated_tokens for t in totals),
        }
        assert ours == engine, by
    assert sum(t.calls for t in service.usage.totals("agent")) == len(finished)


def test_parse_takes_a_label_of_the_set_only():
    assert parse('{"label": "misread", "reason": "read 5 as 6"}') == ("misread", "read 5 as 6")
    assert parse('{"label": "stuck", "reason": "gave up wh') == ("stuck", "")  # cut off
    assert parse('{"label": "confused", "reason": "x"}') is None
    assert parse("careless: a slip") is None


@pytest.mark.slow
def test_a_135m_models_diagnosis_label_is_always_valid():
    config = EngineConfig.from_kwargs(model="smollm2-135m-instruct", dtype="bfloat16")
    server = AsyncEngine(lambda: LLMEngine(config))
    courses = load_courses()
    cases = [
        (course, p, wrong)
        for course in courses.values()
        for p in course.problems[:3]
        for wrong in ("41", "I think it is 7")
    ]

    async def go():
        await server.start()
        llm = EngineLLM(server, "smollm2")
        try:
            return await asyncio.gather(
                *(
                    complete(
                        llm,
                        diagnose_messages(c, p, w, []),
                        max_tokens=64,
                        temperature=1.0,
                        schema=DIAGNOSIS_SCHEMA,
                    )
                    for c, p, w in cases
                )
            )
        finally:
            await server.stop()

    texts = asyncio.run(go())
    for text in texts:
        found = parse(text)
        assert found is not None and found[0] in ERROR_LABELS, text
        if text.rstrip().endswith("}"):
            assert json.loads(text)["label"] in ERROR_LABELS
