"""KV tiers below the pool: restored prefixes give the same tokens as recomputing them;
sessions keep their history across turns and restarts; bad files are never loaded."""

import logging
import os
import random
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from tutorserve import LLM, SamplingParams
from tutorserve.engine.kv_tiers.disk import DiskTier
from tutorserve.engine.kv_tiers.lru import LruIndex
from tutorserve.layers.attention import selector
from tutorserve.models.synth import SynthSpec, synth_model
from tutorserve.paging import hash_block

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BS = 16


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 470) for _ in range(n)]


@pytest.fixture(scope="module")
def history():
    return tokens(300, 0)


@pytest.fixture(scope="module")
def reference(synth_llama, history):
    llm = LLM(synth_llama, dtype="float32", enable_prefix_caching=False, kv_ram_bytes=0)
    return llm.generate([history], GREEDY)[0].token_ids


def tiered(model, tmp_path, ram=1 << 20, disk=1 << 30, blocks=64, **kw):
    return LLM(
        model,
        dtype="float32",
        num_kv_blocks=blocks,
        kv_ram_bytes=ram,
        kv_disk_bytes=disk,
        kv_disk_dir=str(tmp_path),
        **kw,
    )


def flush_pool(llm, seed=100, n=4):
    """Unrelated prompts that take every pool block, so earlier prefixes leave the pool."""
    for i in range(n):
        llm.generate([tokens(300, seed + i)], GREEDY)


def stats(llm):
    return {t.name: t.stats for t in llm.engine.store.tiers}


def assert_no_leaks(llm):
    pool = llm.engine.kv.pool
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks


def test_lru_evicts_expired_sessions_then_plain_then_live_sessions():
    idx = LruIndex(capacity_bytes=40)
    now = time.time()
    idx.add(b"expired", 10, expires_at=now - 1)
    idx.add(b"plain1", 10)
    idx.add(b"live", 10, expires_at=now + 100)
    idx.add(b"plain2", 10)
    idx.touch(b"plain1")  # now more recent than plain2
    assert idx.victims(10, now) == [b"expired"]
    assert idx.victims(30, now) == [b"expired", b"plain2", b"plain1"]
    assert idx.victims(40, now) == [b"expired", b"plain2", b"plain1", b"live"]
    idx.touch(b"plain2", expires_at=now + 200)  # a session takes it: protected now
    assert idx.victims(30, now) == [b"expired", b"plain1", b"live"]


def test_prefix_restored_from_ram_matches_recompute(synth_llama, tmp_path, history, reference):
    llm = tiered(synth_llama, tmp_path, disk=0)
    assert llm.generate([history], GREEDY)[0].token_ids == reference
    flush_pool(llm)
    assert llm.engine.kv.pool.lookup(hash_block(b"", history[:BS])) is None  # left the pool
    misses = stats(llm)["ram"].misses
    assert misses == 5  # the first request and the four unrelated ones found nothing
    out = llm.generate([history], GREEDY)[0]
    assert out.token_ids == reference
    assert out.metrics.num_cached_tokens == (len(history) - 1) // BS * BS
    assert stats(llm)["ram"].hits == (len(history) - 1) // BS  # the pool had none of it
    assert stats(llm)["ram"].misses == misses
    assert_no_leaks(llm)


def test_prefix_restored_from_disk_matches_recompute(synth_llama, tmp_path, history, reference):
    # No RAM tier: spilled blocks go straight to disk and come back through the reader thread.
    llm = tiered(synth_llama, tmp_path, ram=0)
    assert [t.name for t in llm.engine.store.tiers] == ["disk"]
    llm.generate([history], GREEDY)
    flush_pool(llm)
    llm.engine.store._writer.submit(lambda: None).result()  # queued writes are on disk
    out = llm.generate([history], GREEDY)[0]
    assert out.token_ids == reference
    assert out.metrics.num_cached_tokens == (len(history) - 1) // BS * BS
    assert stats(llm)["disk"].hits > 0
    assert_no_leaks(llm)


def test_batch_under_pressure_with_tiers_matches_reference(synth_llama, mixed_prompts, tmp_path):
    plain = LLM(synth_llama, dtype="float32", enable_prefix_caching=False, kv_ram_bytes=0)
    want = [o.token_ids for o in plain.generate(mixed_prompts, GREEDY)]
    llm = tiered(synth_llama, tmp_path, ram=64 << 10, blocks=24)  # RAM holds 8 blocks
    for _ in range(2):  # the second round restores what the first spilled
        outs = llm.generate(mixed_prompts, GREEDY)
        assert [o.token_ids for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert stats(llm)["ram"].hits + stats(llm)["disk"].hits > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("session", ["student-7", None])
def test_session_turns_prefill_only_new_tokens(synth_llama, tmp_path, session):
    # RAM for 30 blocks: other students' spilled blocks would push a history of up to 15
    # blocks out, unless it belongs to a session, which is kept ahead of them.
    llm = tiered(synth_llama, tmp_path, disk=0, ram=30 * 8192)
    assert llm.engine.store.ram.index.capacity_bytes // block_bytes(llm) == 30
    prompt, computed = tokens(120, 1), 0
    for turn in range(3):
        out = llm.generate([prompt], GREEDY, session_id=session)[0]
        if turn and session:
            # Everything the last turn computed (its prompt and reply but the final token),
            # in whole blocks, comes from the tiers: only the new tokens are prefilled.
            assert out.metrics.num_cached_tokens == computed // BS * BS
            assert len(prompt) - out.metrics.num_cached_tokens < 20 + BS
        elif turn:
            assert out.metrics.num_cached_tokens < computed // BS * BS
        computed = len(prompt) + len(out.token_ids) - 1
        flush_pool(llm, seed=200 + 10 * turn, n=8)  # others' traffic: ~100 blocks spill
        prompt = prompt + out.token_ids + tokens(20, 50 + turn)
    assert_no_leaks(llm)


def block_bytes(llm):
    return torch.Size(llm.engine.store.shape).numel() * 4


def test_session_persists_across_restart(synth_llama, tmp_path, history, reference):
    with tiered(synth_llama, tmp_path) as llm:
        llm.generate([history], GREEDY, session_id="s")
    restarted = tiered(synth_llama, tmp_path)
    out = restarted.generate([history], GREEDY)[0]
    assert out.token_ids == reference
    assert out.metrics.num_cached_tokens == (len(history) - 1) // BS * BS
    assert stats(restarted)["disk"].hits == (len(history) - 1) // BS


def test_blocks_stored_under_one_kv_layout_are_not_read_under_another(
    bf16_dot_isa, tmp_path, history, monkeypatch
):
    """A bf16 model of head size 64 pairs its KV cache where the bf16 dot product runs
    (`kernels/kv_format.h`); a restart that lays it out otherwise (a forced lower ISA level,
    another host) recomputes the session instead of reading paired words as rows, and one
    that lays it out alike restores it."""
    spec = SynthSpec(arch="llama", hidden=192, heads=3, kv_heads=1, seed=7)
    model = str(synth_model(tmp_path / "model", spec))
    outs = []
    for paired in (True, False, True):
        monkeypatch.setattr(selector.kernel, "pairs_kv", lambda *_, p=paired: p)
        with LLM(model, dtype="bfloat16", kv_ram_bytes=0, kv_disk_bytes=1 << 30,
                 kv_disk_dir=str(tmp_path / "kv")) as llm:  # fmt: skip
            outs.append(llm.generate([history], GREEDY, session_id="s")[0])
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, (len(history) - 1) // BS * BS]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def corrupt_flip(path):
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))


def corrupt_truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def corrupt_fingerprint(path):
    raw = bytearray(path.read_bytes())
    raw[6:22] = bytes(16)  # header: magic (4), version (2), fingerprint (16)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [corrupt_flip, corrupt_truncate, corrupt_fingerprint])
def test_damaged_files_are_dropped_and_recomputed(
    synth_llama, tmp_path, history, reference, damage, caplog
):
    with tiered(synth_llama, tmp_path, ram=0) as llm:
        llm.generate([history], GREEDY, session_id="s")
        folder = llm.engine.store.disk.dir
    files = sorted(folder.glob("*.kvb"))
    assert len(files) == (len(history) + GREEDY.max_tokens - 1) // BS
    for path in files:
        damage(path)
    caplog.set_level(logging.ERROR, logger="tutorserve")
    restarted = tiered(synth_llama, tmp_path, ram=0)
    out = restarted.generate([history], GREEDY)[0]
    assert out.token_ids == reference
    assert out.metrics.num_cached_tokens == 0
    disk = restarted.engine.store.disk
    assert disk.stats.errors > 0 and disk.stats.hits == 0
    assert "will be recomputed" in caplog.text
    assert not any(p.exists() for p in files[:1])  # the damaged first block is gone


def test_budgets_are_never_exceeded(synth_llama, tmp_path):
    ram_cap, disk_cap = 100 << 10, 300 << 10
    llm = tiered(synth_llama, tmp_path, ram=ram_cap, disk=disk_cap, blocks=32)
    for i in range(6):
        llm.generate([tokens(250, 300 + i)], GREEDY, session_id=f"s{i}")
        store = llm.engine.store
        assert store.ram.used_bytes <= ram_cap
        store._writer.submit(lambda: None).result()
        on_disk = sum(p.stat().st_size for p in store.disk.dir.iterdir())
        assert store.disk.used_bytes == on_disk <= disk_cap
    assert len(store.disk) > 0 and len(store.ram) > 0


def test_interrupted_writes_are_cleaned_up(tmp_path):
    shape, fp = (2, 1, 1, 4, 8), b"f" * 16
    disk = DiskTier(tmp_path, 1 << 20, fp, shape, torch.float32)
    leftover = disk.dir / "ab.kvb.1234.tmp"
    leftover.write_bytes(b"half a block")
    os.utime(leftover, (time.time() - 3600,) * 2)  # a fresh one may be another process's
    disk.put(b"k" * 16, torch.ones(shape))
    again = DiskTier(tmp_path, 1 << 20, fp, shape, torch.float32)
    assert [p.suffix for p in again.dir.iterdir()] == [".kvb"]
    assert torch.equal(again.get(b"k" * 16), torch.ones(shape))


def test_concurrent_readers_and_writers_are_safe(tmp_path):
    shape = (2, 1, 1, 4, 8)
    disk = DiskTier(tmp_path, 40 * 2 * 64 * 4, b"f" * 16, shape, torch.float32)  # ~40 blocks
    keys = [bytes([i]) * 16 for i in range(80)]
    errors = []

    def writer():
        for i, key in enumerate(keys):
            disk.put(key, torch.full(shape, float(i)))

    def reader():
        for _ in range(3):
            for i, key in enumerate(keys):
                data = disk.get(key)
                if data is not None and not torch.equal(data, torch.full(shape, float(i))):
                    errors.append(key)

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert disk.used_bytes <= disk.capacity_bytes and disk.stats.errors == 0


def test_slow_disk_read_does_not_stall_other_requests(synth_llama, tmp_path, history, monkeypatch):
    with tiered(synth_llama, tmp_path, ram=0) as llm:
        llm.generate([history], GREEDY, session_id="s")
    llm = tiered(synth_llama, tmp_path, ram=0)
    slow_get = DiskTier.get

    def get(self, key):
        time.sleep(0.05)
        return slow_get(self, key)

    monkeypatch.setattr(DiskTier, "get", get)  # ~18 blocks: about a second of reading
    engine = llm.engine
    engine.add_request("restore", history, GREEDY)
    engine.add_request("other", tokens(40, 9), GREEDY)
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["other", "restore"]
    assert engine.store.disk.stats.hits == (len(history) - 1) // BS


def test_bench_kv_restore_restores_every_history_block(synth_llama, tmp_path):
    from tutorserve.bench.kv_restore import restore_table, run_restore

    opts = dict(dtype="float32", kv_ram_bytes=1 << 26, kv_disk_bytes=1 << 26)
    (res,) = run_restore(synth_llama, [96], 2, opts, label="tiny")
    assert res.cached_tokens == {"recompute": [0, 0], "ram": [96, 96], "disk": [96, 96]}
    assert all(len(v) == 2 and min(v) > 0 for v in res.ttft_s.values())
    assert "| tiny | 96 |" in restore_table([res])


class InlineExecutor:
    """Runs each task inside `submit`: a disk read that finishes before its start returns."""

    def submit(self, fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, **_):
        pass


def test_read_finishing_at_once_leaves_nothing_waiting(synth_llama, tmp_path, history, reference):
    with tiered(synth_llama, tmp_path, ram=0) as llm:
        llm.generate([history], GREEDY, session_id="s")
    llm = tiered(synth_llama, tmp_path, ram=0)
    llm.engine.store._reader = InlineExecutor()
    out = llm.generate([history], GREEDY)[0]
    assert out.token_ids == reference
    assert out.metrics.num_cached_tokens == (len(history) - 1) // BS * BS
    assert not llm.engine.store._reading
