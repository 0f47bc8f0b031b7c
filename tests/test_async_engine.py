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


def _run(server, *submissions):
    """Start `server`, drain each (id, prompt, params, n) submission, stop; the outputs."""

    async def run():
        await server.start()
        streams = [server.submit(rid, p, params, n=n) for rid, p, params, n in submissions]
        outs = [[out async for out in s] for s in streams]
        await server.stop()
        return outs

    return asyncio.run(run())


def test_n_choices_share_the_prompt_blocks_and_differ_by_seed(synth_llama):
    server = AsyncEngine(
        lambda: LLMEngine(EngineConfig.from_kwargs(model=synth_llama, dtype="float32"))
    )
    engine = server.engine
    bs = engine.config.block_size
    prompt = [(7 * i) % 400 + 3 for i in range(3 * bs + 5)]  # 3 full blocks and a partial one
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    (outs,) = _run(server, ("r", prompt, params, 4))
    finals = {o.index: o for o in outs if o.finished}
    assert sorted(finals) == [0, 1, 2, 3]
    assert {o.request_id for o in outs} == {"r", "r#1", "r#2", "r#3"}
    # Choices 1-3 found the prompt's full blocks cached by choice 0.
    assert [finals[i].metrics.num_cached_tokens for i in range(4)] == [0, 3 * bs, 3 * bs, 3 * bs]
    assert len({tuple(finals[i].token_ids) for i in range(4)}) == 4  # seeds 11..14 differ
    assert engine.kv.num_used_blocks == 0  # every choice gave its blocks back

    # Choice i is what a lone request with seed 11 + i samples.
    alone = AsyncEngine(
        lambda: LLMEngine(EngineConfig.from_kwargs(model=synth_llama, dtype="float32"))
    )
    lone = SamplingParams(temperature=1.0, seed=13, max_tokens=8, ignore_eos=True)
    (solo,) = _run(alone, ("s", prompt, lone, 1))
    assert solo[-1].token_ids == finals[2].token_ids


def test_closing_an_n_choice_stream_aborts_every_choice(synth_llama):
    server = AsyncEngine(
        lambda: LLMEngine(EngineConfig.from_kwargs(model=synth_llama, dtype="float32"))
    )
    params = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)

    async def run():
        await server.start()
        stream = server.submit("r", list(range(3, 40)), params, n=3)
        seen = set()
        async for out in stream:
            seen.add(out.index)
            if len(seen) == 3:
                break
        stream.close()
        while server.engine.has_unfinished() or server._aborts:
            await asyncio.sleep(0.01)
        await server.stop()
        return seen

    assert asyncio.run(run()) == {0, 1, 2}
    assert server.engine.kv.num_used_blocks == 0
    assert not server.engine.seqs
