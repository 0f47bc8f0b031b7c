"""The engine's asyncio front: the engine is built, and stepped, on one thread of its own."""

import asyncio
import threading

import pytest

from tutorserve import SamplingParams
from tutorserve.config import EngineConfig
from tutorserve.engine.async_engine import AsyncEngine
from tutorserve.engine.engine import LLMEngine


def test_the_engine_is_built_and_stepped_on_its_own_thread(synth_llama):
    threads = {}

    def make_engine() -> LLMEngine:
        threads["built"] = threading.current_thread()
        engine = LLMEngine(EngineConfig.from_kwargs(model=synth_llama, dtype="float32"))
        step = engine.step

        def recorded_step():
            threads["stepped"] = threading.current_thread()
            return step()

        engine.step = recorded_step
        return engine

    server = AsyncEngine(make_engine)
    assert threads["built"] is not threading.current_thread()

    async def run():
        await server.start()
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outputs = [out async for out in server.submit("r", [1, 2, 3], params)]
        await server.stop()
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 5
    assert threads["stepped"] is threads["built"]


def test_an_engine_that_fails_to_build_raises_from_the_constructor():
    def make_engine() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(make_engine)
