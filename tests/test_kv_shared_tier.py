"""A disk tier folder shared by several processes (replicas on one host or a shared filesystem):
a block one writes, another finds, byte for byte; concurrent writers of one block leave one
valid file; damaged or vanished files are misses, never errors; another process's fresh
temporary files are left alone. And a session one engine kept, another engine resumes."""

import multiprocessing
import os
import random
import time

import torch

from tutorserve import LLM, SamplingParams
from tutorserve.engine.kv_tiers.disk import DiskTier

SHAPE, FP = (2, 2, 1, 4, 8), b"f" * 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BS = 16


def tier(folder, capacity=1 << 20):
    return DiskTier(folder, capacity, FP, SHAPE, torch.float32)


def block(seed):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _write(folder, keys, seed, rounds):
    """In a child process: write these blocks `rounds` times each, as a replica would."""
    disk = tier(folder)
    for _ in range(rounds):
        for key in keys:
            disk._remove(key)  # forget it, so `put` writes the file again
            disk.put(key, block(seed))


def in_processes(*calls):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write, args=args) for args in calls]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * len(procs)


def test_a_block_written_by_another_process_is_found_byte_identical(tmp_path):
    reader = tier(tmp_path)  # scanned the folder before the block existed
    key = b"a" * 16
    assert not reader.has(key) and reader.get(key) is None
    in_processes((tmp_path, [key], 7, 1))
    assert key not in reader.index
    assert reader.has(key)  # adopted from the other process's file
    assert torch.equal(reader.get(key), block(7))
    assert reader.stats.errors == 0 and len(reader) == 1
    other = tier(tmp_path)  # a second reader that goes straight to `get`
    other.index.remove(key)
    assert torch.equal(other.get(key), block(7)) and key in other.index


def test_concurrent_writers_of_one_block_leave_one_valid_file(tmp_path):
    keys = [bytes([i]) * 16 for i in range(4)]
    in_processes((tmp_path, keys, 3, 30), (tmp_path, keys, 3, 30))
    folder = tier(tmp_path).dir
    assert sorted(p.name for p in folder.iterdir()) == sorted(k.hex() + ".kvb" for k in keys)
    fresh = tier(tmp_path)
    for key in keys:
        assert torch.equal(fresh.get(key), block(3))
    assert fresh.stats.errors == 0


def flip(path):
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-64])


def foreign(path):
    raw = bytearray(path.read_bytes())
    raw[6:22] = bytes(16)  # the header's model fingerprint
    path.write_bytes(bytes(raw))


def test_damaged_files_from_another_process_are_misses(tmp_path):
    keys = {damage: bytes([i + 1]) * 16 for i, damage in enumerate((flip, truncate, foreign))}
    writer, reader = tier(tmp_path), tier(tmp_path)
    for damage, key in keys.items():
        writer.put(key, block(1))
        damage(writer._path(key))
    for damage, key in keys.items():
        # A bad header shows at lookup; a bad payload only when read in full.
        assert reader.get(key) is None if damage is flip else not reader.has(key), damage
        assert not writer._path(key).exists()
    assert reader.stats.errors == 3 and len(reader) == 0


def test_a_file_another_process_evicted_is_a_miss(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)
    key = b"e" * 16
    a.put(key, block(2))
    assert b.has(key)
    a._remove(key)  # a's eviction deletes the file b has indexed
    assert b.get(key) is None and key not in b.index
    assert not b.touch(key)
    assert b.stats.errors == 0


def test_only_stale_temporary_files_are_removed_at_start(tmp_path):
    folder = tier(tmp_path).dir
    fresh, stale = folder / "aa.kvb.1111.tmp", folder / "bb.kvb.2222.tmp"
    for path in (fresh, stale):
        path.write_bytes(b"part of a block")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    tier(tmp_path)
    assert fresh.exists() and not stale.exists()


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 470) for _ in range(n)]


def engine(model, folder, write_through):
    return LLM(model, dtype="float32", num_kv_blocks=64, kv_ram_bytes=1 << 24,
               kv_disk_bytes=1 << 28, kv_disk_dir=str(folder),
               session_write_through=write_through)  # fmt: skip


def finish_turn(llm, request_id, prompt):
    """One session turn, stepped by hand: the engine never idles, so nothing is flushed."""
    llm.engine.add_request(request_id, prompt, GREEDY, session_id="student-3")
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.store._writer.submit(lambda: None).result()  # queued writes are done


def test_another_engine_resumes_a_session_written_through(synth_llama, tmp_path):
    history = tokens(150, 4)
    plain = LLM(synth_llama, dtype="float32", enable_prefix_caching=False, kv_ram_bytes=0)
    reference = plain.generate([history], GREEDY)[0].token_ids
    lazy = engine(synth_llama, tmp_path / "lazy", write_through=False)
    finish_turn(lazy, "t1", history[:100])
    assert len(lazy.engine.store.disk) == 0  # kept in RAM until the engine idles
    replica_a = engine(synth_llama, tmp_path / "shared", write_through=True)
    replica_b = engine(synth_llama, tmp_path / "shared", write_through=True)
    finish_turn(replica_a, "t1", history[:100])
    assert len(replica_a.engine.store.disk) == 100 // BS
    out = replica_b.generate([history], GREEDY, session_id="student-3")[0]
    assert out.metrics.num_cached_tokens == 100 // BS * BS
    assert replica_b.engine.store.disk.stats.hits == 100 // BS
    assert out.token_ids == reference
