"""Prefill/decode disaggregation (`serve --prefill-replicas 1 --decode-replicas 1`): the options'
rules, the hand-off's fallback on its own (fakes, no Ray), and on Ray Serve in this process:
greedy text equal to one engine's, the decode replica taking the prompt's blocks from the shared
folder, and both replicas' blocks back to idle once the requests end."""

import asyncio
import threading
import time

import pytest

from tutorserve import LLM, SamplingParams
from tutorserve.cli import main
from tutorserve.cluster.disagg import PrefillThenDecode
from tutorserve.engine.async_engine import AdmissionError
from tutorserve.engine.outputs import RequestMetrics, RequestOutput

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)


PD = ["--prefill-replicas", "1", "--decode-replicas", "1"]
SHARED = [*PD, "--kv-disk-dir", "/tmp/kv"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-replicas", "1"], "go together"),
        (["--decode-replicas", "2"], "go together"),
        ([*PD, "--ray-address", "10.0.0.1:6379"], "give --kv-disk-dir"),
        ([*SHARED, "--kv-disk-gb", "0"], "nonzero --kv-disk-gb"),
        ([*SHARED, "--max-replicas", "3"], "fixed sizes"),
        ([*SHARED, "--replicas", "2"], "not both"),
        ([*SHARED, "--prefill-replicas", "0"], "at least 1"),
    ],
)
def test_disaggregation_options_are_checked_before_anything_starts(
    args, message, capsys, monkeypatch
):
    monkeypatch.delenv("TUTORSERVE_KV_DIR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # Checked before the model loads: the model named here does not exist.
    assert main(["serve", "--model", "/nonexistent", "--no-tutor", *args]) == 2
    assert message in capsys.readouterr().err


# ---- the prefill side's write barrier -------------------------------------------------------


def test_the_write_barrier_waits_for_the_blocks_and_never_forever(
    synth_llama, tmp_path, monkeypatch
):
    from tutorserve.engine.kv_tiers.disk import DiskTier
    from tutorserve.paging import extend_block_hashes

    llm = LLM(synth_llama, dtype="float32", kv_ram_bytes=1 << 20, kv_disk_bytes=1 << 30,
              kv_disk_dir=str(tmp_path), session_write_through=True)  # fmt: skip
    store = llm.engine.store
    put = DiskTier.put

    def slow_put(self, key, data, expires_at=0.0):
        time.sleep(0.05)  # ~10 blocks: half a second of writing after the request ends
        put(self, key, data, expires_at)

    monkeypatch.setattr(DiskTier, "put", slow_put)
    one_token = SamplingParams(temperature=0, max_tokens=1)

    def prefill(seed):
        ids = [(seed * 31 + i * 7) % 400 + 3 for i in range(10 * BS + 3)]
        llm.generate([ids], one_token, session_id=f"s{seed}")
        return extend_block_hashes([], ids, BS)

    keys = prefill(1)
    assert store.wait_written(keys, timeout=30)
    # Writes skipped for a full backlog: nothing to wait for, and the answer is no.
    monkeypatch.setattr(store, "_backlog", 1 << 40)
    keys = prefill(2)
    start = time.monotonic()
    assert not store.wait_written(keys, timeout=30)
    assert time.monotonic() - start < 5
    # A stuck writer: the timeout ends the wait.
    monkeypatch.setattr(store, "_backlog", 0)
    stuck = threading.Event()
    store._writer.submit(stuck.wait)
    keys = prefill(3)
    start = time.monotonic()
    assert not store.wait_written(keys, timeout=0.3)
    assert time.monotonic() - start < 5
    stuck.set()
    assert store.wait_written(keys, timeout=30)  # written once the writer moves on
    llm.close()


# ---- the hand-off, with fakes --------------------------------------------------------------


def _output(text):
    metrics = RequestMetrics(0.0, None, None, 3, 0, 1, 0)
    return RequestOutput("r", None, [1, 2, 3], text, [7], True, "length", metrics)


class FakePrefill:
    """A prefill replica's answer: blocks written, an error, or nothing (a stuck replica)."""

    def __init__(self, result=None, error=None):
        self.result, self.error, self.cancelled = result, error, False

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        if self.error is not None:
            raise self.error
        if self.result is None:
            await asyncio.sleep(3600)
        return self.result

    def cancel(self):
        self.cancelled = True


class FakeDecode:
    def __init__(self, outputs):
        self.outputs, self.cancelled = list(outputs), False

    async def __anext__(self):
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop(0)

    def cancel(self):
        self.cancelled = True


def _handoff(prefill, timeout_s=5.0):
    started = []

    def decode():
        started.append(FakeDecode([_output("same text")]))
        return started[-1]

    return PrefillThenDecode("r", prefill, decode, timeout_s), started


@pytest.mark.parametrize(
    ("prefill", "prefilled"),
    [
        (FakePrefill(result=4), True),
        (FakePrefill(error=RuntimeError("prefill replica died")), False),
        (FakePrefill(), False),  # never answers: the timeout ends the wait
    ],
)
def test_the_decode_replica_serves_the_request_whether_or_not_the_prefill_did(prefill, prefilled):
    call, started = _handoff(prefill, timeout_s=0.5)
    out = asyncio.run(call.__anext__())
    assert out.text == "same text" and len(started) == 1
    assert call.prefilled is prefilled
    assert prefill.cancelled is not prefilled  # a failed or late prefill is cancelled


def test_a_request_closed_during_its_prefill_never_reaches_a_decode_replica():
    prefill = FakePrefill()
    call, started = _handoff(prefill)

    async def close_early():
        read = asyncio.ensure_future(call.__anext__())
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(read, 10)  # the cancelled prefill ends the wait

    # The fake prefill ignores its cancel, like a reply already on its way: the read still
    # ends (at the timeout) without starting a decode call.
    call._timeout_s = 0.3
    asyncio.run(close_early())
    assert prefill.cancelled and not started


# ---- on Ray Serve -----------------------------------------------------------------------------


class PDCluster:
    """`serve --prefill-replicas 1 --decode-replicas 1` without the HTTP server: the test reads
    each request's outputs from the front, and each replica's counters through Serve."""

    def __init__(self, model, kv_dir):
        from tutorserve.cli import _cluster_front, build_parser
        from tutorserve.cluster.scaling import scale_from_args
        from tutorserve.config import EngineConfig, engine_options

        a = build_parser().parse_args([
            "serve", "--model", model, "--prefill-replicas", "1", "--decode-replicas", "1",
            "--no-tutor", "--num-kv-blocks", "512", "--dtype", "float32",
            "--kv-disk-dir", str(kv_dir), "--enable-lora",
        ])  # fmt: skip
        config = EngineConfig.from_kwargs(**engine_options(a))
        self.front = _cluster_front(a, config, scale_from_args(a, batch=a.max_num_seqs))

    def run(self, prompts, params=GREEDY):
        """Each prompt's final output, the requests running together."""

        async def one(i, ids):
            async with self.front.submit(f"pd-{time.monotonic_ns()}-{i}", ids, params) as s:
                async for out in s:
                    if out.finished:
                        return out
            raise AssertionError("no final output")

        async def all_of():
            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

        return asyncio.run(asyncio.wait_for(all_of(), 300))

    def stats(self, handle):
        got = handle.broadcast("stats").results(timeout_s=30)
        return [stats for _, stats, _ in got]

    def stop(self):
        self.front._shutdown()


@pytest.fixture(scope="module")
def pd(synth_llama, tmp_path_factory):
    cluster = PDCluster(synth_llama, tmp_path_factory.mktemp("kv"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def single(synth_llama):
    engine = LLM(synth_llama, dtype="float32", enable_prefix_caching=False, kv_ram_bytes=0)

    def generate(prompts):
        return [o.text for o in engine.generate(prompts, GREEDY)]

    generate.tokenizer = engine.tokenizer
    return generate


def _prompts(tokenizer, tag):
    texts = [
        f"{tag}: a fraction names parts of a whole; 3/4 is three of four equal parts. " * 6,
        f"{tag}: what is 1/2 + 1/3? Use a common denominator. " * 3,
        f"{tag} hi",  # under one block: goes straight to a decode replica
    ]
    return [tokenizer.encode(t) for t in texts]


def test_prefill_decode_gives_one_engines_greedy_text_from_the_prefills_blocks(pd, single):
    prompts = _prompts(single.tokenizer, "Lesson 1")
    assert len(prompts[0]) > 6 * BS and len(prompts[2]) < BS
    outs = pd.run(prompts)
    assert [o.text for o in outs] == single(prompts)
    # The decode replica computed only each prompt's last, partial block.
    for ids, out in zip(prompts, outs, strict=True):
        assert out.metrics.num_cached_tokens == (len(ids) - 1) // BS * BS, (len(ids), out.metrics)
    (prefill,) = pd.stats(pd.front.prefill)
    (decode,) = pd.stats(pd.front.handle)
    written = (len(prompts[0]) // BS) + (len(prompts[1]) // BS)
    assert prefill.prefix_query_tokens == len(prompts[0]) + len(prompts[1])
    disk = {t.name: t for t in decode.tiers}["disk"]
    assert disk.hits == (len(prompts[0]) - 1) // BS + (len(prompts[1]) - 1) // BS <= written


def _idle(stats):
    return (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)


def test_block_accounting_is_clean_on_both_sides_after_requests_end(pd, single):
    prompts = _prompts(single.tokenizer, "Lesson 2")
    pd.run(prompts)

    async def leave_early():  # a client that leaves after the first token
        ids = prompts[0] + single.tokenizer.encode(" and again")
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        async with pd.front.submit("leaves", ids, params) as s:
            first = await s.__anext__()
            assert not first.finished

    asyncio.run(asyncio.wait_for(leave_early(), 300))
    deadline = time.monotonic() + 60  # the abort reaches the replica on its own time
    while not all(_idle(s) for h in (pd.front.prefill, pd.front.handle) for s in pd.stats(h)):
        assert time.monotonic() < deadline, [pd.stats(h) for h in pd.front.handles]
        time.sleep(0.5)
    for handle in pd.front.handles:
        (stats,) = pd.stats(handle)
        assert stats.kv_blocks_free == stats.kv_blocks  # cached blocks count as free


def test_health_names_each_replicas_role(pd):
    async def roles():
        await pd.front.start()  # its stats rounds
        try:
            for _ in range(100):
                if len(replicas := pd.front.health()["replicas"]) == 2:
                    return sorted(r["role"] for r in replicas.values())
                await asyncio.sleep(0.2)
            raise AssertionError(f"not every replica answered: {pd.front.health()}")
        finally:
            pd.front._refresh.cancel()

    assert asyncio.run(roles()) == ["decode", "prefill"]
    # The metrics' labels too, and only the decode replica counts towards the waiting cap.
    assert sorted(role for _, role in pd.front.replica_stats()) == ["decode", "prefill"]
    cap, pd.front.max_waiting = pd.front.max_waiting, 1
    try:
        stream = pd.front.submit("capped-0", [1, 2, 3], SamplingParams(max_tokens=1))
        with pytest.raises(AdmissionError):
            pd.front.submit("capped-1", [1, 2, 3], SamplingParams(max_tokens=1))
        stream.close()
    finally:
        pd.front.max_waiting = cap


class FailingPrefills:
    """A prefill deployment whose every call fails (as a dead replica's would)."""

    class _Method:
        def remote(self, *args, **kwargs):
            return FakePrefill(error=RuntimeError("no prefill replica"))

    prefill = _Method()


def test_a_failed_prefill_falls_back_to_the_decode_replica_with_the_same_text(pd, single):
    prompts = _prompts(single.tokenizer, "Lesson 3")[:2]
    real, pd.front.prefill = pd.front.prefill, FailingPrefills()
    try:
        outs = pd.run(prompts)
    finally:
        pd.front.prefill = real
    assert [o.text for o in outs] == single(prompts)
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0]  # the decode computed them


def test_an_adapters_request_with_two_choices_goes_through_prefill_and_decode(
    pd, synth_llama, tmp_path
):
    """The prefill replica writes the prompt's blocks under the adapter's keys, and the decode
    replica finds them under the same keys; both choices equal one engine with the adapter."""
    from tutorserve.lora.synth import synth_lora
    from tutorserve.models.loader import load_model_config

    path = str(synth_lora(tmp_path / "geometry", load_model_config(synth_llama), 8, seed=4))
    llm = LLM(synth_llama, dtype="float32", lora_modules={"geometry": path}, max_lora_rank=16,
              enable_prefix_caching=False, kv_ram_bytes=0)  # fmt: skip
    ids = llm.tokenizer.encode("Lesson 3: the angles of a triangle add up to 180 degrees. " * 5)
    expected = llm.generate([ids], GREEDY, lora="geometry")[0]
    assert expected.text != llm.generate([ids], GREEDY)[0].text  # the adapter matters
    llm.close()

    async def two_choices():
        await pd.front.load_lora("geometry", path)
        try:
            finals = {}
            async with pd.front.submit("pd-lora", ids, GREEDY, lora="geometry", n=2) as s:
                async for out in s:
                    if out.finished:
                        finals[out.index] = out
            return finals
        finally:
            await pd.front.unload_lora("geometry")

    finals = asyncio.run(asyncio.wait_for(two_choices(), 300))
    assert sorted(finals) == [0, 1]
    assert [finals[i].text for i in range(2)] == [expected.text] * 2
    # Choice 0 came from the prefill's blocks; choice 1 from the blocks choice 0 left.
    assert finals[0].metrics.num_cached_tokens == (len(ids) - 1) // BS * BS
