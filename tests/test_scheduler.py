"""Scheduler: token budget, chunked prefill next to decodes, row order, sequence cap, preemption
order and progress, priorities and prefix-cache hits. The engine is simulated: no model."""

import random
from collections import Counter

import pytest

from tutorserve.config import EngineConfig
from tutorserve.engine.kv_cache_manager import KVCacheManager
from tutorserve.engine.scheduler import Scheduler
from tutorserve.engine.sequence import Sequence, SequenceStatus
from tutorserve.sampling_params import SamplingParams


def make_scheduler(num_blocks, block_size=4, max_num_seqs=64, budget=64, prefix=True):
    cfg = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix,
    )
    cfg.validate()
    kv = KVCacheManager(num_blocks, block_size, prefix)
    return Scheduler(cfg, kv), kv


def make_seq(rid, tokens, max_tokens=4, priority=0):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), priority=priority)


class Sim:
    """Plays the engine around a Scheduler and checks invariants after every step."""

    def __init__(self, sched, kv):
        self.sched, self.kv = sched, kv
        self.finished = []
        self.admitted = []  # request ids in the order they first got scheduled
        self.written = {}  # (block, slot) → the token prefix whose last K/V sits there
        self.admissions = []  # (step, request id) each time a waiting request gets scheduled
        self.steps = 0

    def step(self):
        sched, kv, bs = self.sched, self.kv, self.kv.block_size
        cfg = sched.config
        waiting = set(map(id, sched.waiting))
        out = sched.schedule()
        self.steps += 1
        self.admissions += [(self.steps, s.request_id) for s in out.seqs if id(s) in waiting]
        assert len(out.seqs) == len(out.num_tokens)
        assert out.total_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        assert len(set(map(id, out.seqs))) == len(out.seqs)
        assert all(n >= 1 for n in out.num_tokens)
        if out.preempted:
            assert not any(id(s) in waiting for s in out.seqs), "admitted in a preempting step"
        multi = [n > 1 for n in out.num_tokens]
        assert multi == sorted(multi), "one-token rows must come first"
        for seq in out.preempted:
            assert seq in sched.waiting and seq not in out.seqs
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for seq, n in zip(out.seqs, out.num_tokens, strict=True):
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert seq.num_computed_tokens + n <= seq.num_tokens
            assert len(seq.block_table) * bs >= seq.num_computed_tokens + n
            if seq.request_id not in self.admitted:
                self.admitted.append(seq.request_id)
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = seq.block_table[p // bs]
                assert kv.pool.blocks[block].ref_count == 1, "writing into a shared block"
                self.written[block, p % bs] = tuple(seq.token_ids[: p + 1])
            seq.num_computed_tokens += n
            kv.cache_computed_blocks(seq)
        for seq in out.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(1000 + seq.num_tokens)  # the "sampled" token
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED
                    sched.remove(seq)
                    self.finished.append(seq)
        self.check()
        return out

    def check(self):
        sched, kv, bs = self.sched, self.kv, self.kv.block_size
        kv.pool.check_integrity()
        keys = [s.sort_key() for s in sched.waiting]
        assert keys == sorted(keys)
        held = Counter(b for s in sched.running for b in s.block_table)
        for s in sched.waiting:
            assert s.block_table == [] and s.status is SequenceStatus.WAITING
        for block in kv.pool.blocks:
            assert block.ref_count == held[block.block_id]
        for s in sched.running:
            for p in range(s.num_computed_tokens):
                assert self.written[s.block_table[p // bs], p % bs] == tuple(s.token_ids[: p + 1])

    def run(self, max_steps=10_000):
        while self.sched.has_unfinished():
            assert self.steps < max_steps, "no progress"
            self.step()
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks


def test_budget_respected_and_prefills_chunked():
    sched, kv = make_scheduler(64, budget=8)
    long = make_seq("long", range(1, 31), max_tokens=2)
    sched.add(long)
    sim = Sim(sched, kv)
    chunks = []
    while long.num_output_tokens == 0:
        out = sim.step()
        assert out.seqs == [long]
        chunks.append(out.num_tokens[0])
    assert chunks == [8, 8, 8, 6]
    sim.run()
    assert long.num_output_tokens == 2


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    sched, kv = make_scheduler(64, budget=8)
    d1, d2 = make_seq("d1", [1, 2, 3], max_tokens=20), make_seq("d2", [4, 5, 6], max_tokens=20)
    sched.add(d1)
    sched.add(d2)
    sim = Sim(sched, kv)
    out = sim.step()
    assert out.seqs == [d1, d2] and out.num_tokens == [3, 3]
    long = make_seq("long", range(100, 130), max_tokens=1)
    sched.add(long)
    chunks = []
    while not long.is_finished:
        out = sim.step()
        rows = dict(zip(map(id, out.seqs), out.num_tokens, strict=True))
        assert rows[id(d1)] == 1 and rows[id(d2)] == 1  # decodes every step
        assert out.seqs[:2] == [d1, d2]  # one-token rows first
        assert out.total_tokens == 8 or long.num_computed_tokens == long.num_tokens
        chunks.append(rows[id(long)])
    assert chunks == [6, 6, 6, 6, 6]
    assert d1.num_output_tokens == 6 and d2.num_output_tokens == 6
    sim.run()


def test_one_token_rows_come_before_multi_token_rows():
    sched, kv = make_scheduler(64, budget=64)
    a = make_seq("a", [1, 2], max_tokens=10)
    sched.add(a)
    sim = Sim(sched, kv)
    sim.step()
    b = make_seq("b", range(10, 20), max_tokens=10)
    c = make_seq("c", [7], max_tokens=10)  # a one-token prompt is a one-token row too
    sched.add(b)
    sched.add(c)
    out = sim.step()
    assert out.seqs == [a, c, b]
    assert out.num_tokens == [1, 1, 10]


def test_max_num_seqs_respected():
    sched, kv = make_scheduler(64, max_num_seqs=2, budget=64)
    seqs = [make_seq(f"r{i}", [i + 1, i + 2, i + 3], max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    sim = Sim(sched, kv)
    out = sim.step()
    assert out.seqs == seqs[:2]
    assert sched.waiting == seqs[2:]
    sim.run()
    assert all(len(s.output_token_ids) == 3 for s in seqs)
    assert sim.admitted == [s.request_id for s in seqs]


def test_lower_priority_value_admitted_first():
    sched, kv = make_scheduler(64, max_num_seqs=1)
    order = [("p2", 2), ("p0", 0), ("p1", 1), ("p0b", 0)]
    for rid, prio in order:
        sched.add(make_seq(rid, [1, 2, 3], max_tokens=2, priority=prio))
    sim = Sim(sched, kv)
    sim.run()
    assert sim.admitted == ["p0", "p0b", "p1", "p2"]


def test_admission_is_all_or_nothing_on_blocks_and_in_order():
    sched, kv = make_scheduler(4, budget=64)
    a = make_seq("a", range(1, 12), max_tokens=1)  # 3 blocks
    b = make_seq("b", range(20, 26), max_tokens=1)  # 2 blocks: does not fit next to a
    c = make_seq("c", [30], max_tokens=1)  # would fit, but must not jump ahead of b
    for s in (a, b, c):
        sched.add(s)
    out = Sim(sched, kv).step()
    assert out.seqs == [a]  # then a finished and was removed
    assert sched.waiting == [b, c]
    out = sched.schedule()
    assert out.seqs == [c, b]  # both admitted; the one-token row is listed first


def test_preempted_requests_return_in_arrival_order_ahead_of_later_arrivals():
    sched, kv = make_scheduler(6, budget=64)
    a = make_seq("a", range(1, 8), max_tokens=12)  # 7 tokens: 2 blocks, a third at token 9
    b = make_seq("b", range(11, 18), max_tokens=12)
    c = make_seq("c", range(21, 28), max_tokens=12)
    for s in (a, b, c):
        sched.add(s)
    sim = Sim(sched, kv)
    out = sim.step()
    assert out.seqs == [a, b, c] and kv.num_free_blocks == 0
    d = make_seq("d", [40, 41, 42], max_tokens=2)
    sched.add(d)
    out = sim.step()  # decodes in place; d cannot get a block
    assert out.seqs == [a, b, c] and out.preempted == []
    assert sched.waiting == [d]
    out = sim.step()  # a needs a third block: the latest-arrived running request goes
    assert out.preempted == [c]
    assert out.seqs == [a, b]
    assert sched.waiting == [c, d]
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.num_computed_tokens == 0 and c.block_table == []
    preempted = []
    while not preempted:
        out = sim.step()
        preempted += out.preempted
    assert preempted == [b]
    assert sched.waiting == [b, c, d]  # b went back in ahead of c and d
    sim.run()
    # Re-admission follows arrival order: b, then c, and d (the later arrival) never earlier.
    assert [rid for _, rid in sim.admissions] == ["a", "b", "c", "b", "c", "d"]
    steps = [step for step, _ in sim.admissions]
    assert steps == sorted(steps) and steps[3] < steps[4]
    assert {s.request_id for s in sim.finished} == {"a", "b", "c", "d"}
    assert all(s.num_output_tokens == s.params.max_tokens for s in (a, b, c, d))
    assert c.output_token_ids == [1000 + n for n in range(7, 19)]


def test_preemption_is_not_mixed_with_admission_and_keeps_fifo():
    sched, kv = make_scheduler(4, budget=64)
    a = make_seq("a", range(1, 8), max_tokens=8)  # 7 tokens: 2 blocks, grows to a third
    b = make_seq("b", range(10, 17), max_tokens=8)
    sched.add(a)
    sched.add(b)
    sim = Sim(sched, kv)
    sim.step()
    sim.step()
    late = make_seq("late", [50], max_tokens=1)
    sched.add(late)
    out = sim.step()  # a needs a third block
    assert out.preempted == [b]
    assert late not in out.seqs  # no admission in a step that preempted
    assert sched.waiting == [b, late]
    sim.run()
    steps = dict((rid, step) for step, rid in sim.admissions if rid != "a")
    assert steps["b"] <= steps["late"]  # the preempted request is not overtaken
    assert {s.request_id for s in sim.finished} == {"a", "b", "late"}


def test_prefix_hit_sets_cached_tokens_and_skips_them():
    sched, kv = make_scheduler(32, budget=64)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    first = make_seq("first", prompt, max_tokens=2)
    sched.add(first)
    sim = Sim(sched, kv)
    sim.run()
    assert first.num_cached_tokens == 0

    again = make_seq("again", [*prompt, 99], max_tokens=2)
    exact = make_seq("exact", prompt[:12], max_tokens=2)  # exactly 3 blocks: only 2 may hit
    sched.add(again)
    sched.add(exact)
    out = sched.schedule()
    assert out.seqs == [again, exact]
    assert again.num_cached_tokens == 12 and again.num_computed_tokens == 12
    assert exact.num_cached_tokens == 8 and exact.num_computed_tokens == 8
    assert out.num_tokens == [2, 4]
    assert kv.prefix_query_tokens == 13 + 14 + 12
    assert kv.prefix_hit_tokens == 0 + 12 + 8


def test_prefix_caching_disabled_computes_everything():
    sched, kv = make_scheduler(32, budget=64, prefix=False)
    prompt = list(range(1, 14))
    sim = Sim(sched, kv)
    sched.add(make_seq("first", prompt, max_tokens=2))
    sim.run()
    again = make_seq("again", prompt, max_tokens=2)
    sched.add(again)
    out = sched.schedule()
    assert again.num_cached_tokens == 0 and out.num_tokens == [13]


def test_preempted_request_recomputes_from_prefix_cache():
    sched, kv = make_scheduler(5, budget=64)
    a = make_seq("a", range(1, 8), max_tokens=6)  # 7 tokens: 2 blocks, a third at token 9
    c = make_seq("c", range(21, 30), max_tokens=6)  # 9 tokens: 3 blocks
    sched.add(a)
    sched.add(c)
    sim = Sim(sched, kv)
    sim.step()
    sim.step()
    c_table = list(c.block_table)
    assert c.num_registered_blocks == 2
    out = sim.step()
    assert out.preempted == [c]
    assert a.block_table[2] == c_table[2]  # a took c's partial tail block first
    assert kv.match_prefix(c) == c_table[:2]  # c's full blocks are still cached
    while not a.is_finished:
        out = sim.step()
        assert c not in out.seqs  # 2 idle hits + 1 new block do not fit next to a
    out = sched.schedule()
    assert out.seqs == [c]
    assert c.block_table[:2] == c_table[:2]
    assert c.num_computed_tokens == 8
    assert out.num_tokens == [c.num_tokens - 8]
    assert c.num_cached_tokens == 0  # the first admission's value is kept
    assert kv.prefix_hit_tokens == 8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_tiny_pool_finishes_everything(seed):
    rng = random.Random(seed)
    bs, num_blocks = 4, 8
    sched, kv = make_scheduler(num_blocks, block_size=bs, max_num_seqs=4, budget=10)
    sim = Sim(sched, kv)
    bases = [[rng.randrange(1, 50) for _ in range(16)] for _ in range(3)]
    pending = []
    for i in range(30):
        prompt_len = rng.randrange(1, 17)
        prompt = (
            rng.choice(bases)[:prompt_len]
            if rng.random() < 0.6
            else [rng.randrange(1, 50) for _ in range(prompt_len)]
        )
        # The last computed position is prompt + max_tokens - 1: keep it inside the pool.
        max_tokens = rng.randrange(1, min(16, num_blocks * bs - prompt_len + 1) + 1)
        seq = make_seq(f"r{i}", prompt, max_tokens=max_tokens, priority=rng.choice([0, 0, 1]))
        pending.append((rng.randrange(0, 60), seq))
    pending.sort(key=lambda p: p[0])
    seqs = [s for _, s in pending]
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= sim.steps:
            sched.add(pending.pop(0)[1])
        assert sim.steps < 5_000, "no progress"
        sim.step()
    assert len(sim.finished) == len(seqs)
    for s in seqs:
        assert s.num_output_tokens == s.params.max_tokens
        assert s.output_token_ids == [
            1000 + n for n in range(s.num_prompt_tokens, s.num_prompt_tokens + s.num_output_tokens)
        ]
    assert sched.num_preemptions > 0
    assert kv.prefix_hit_tokens > 0
    assert kv.num_free_blocks == num_blocks
    assert sched.waiting == [] and sched.running == []


def test_remove_waiting_and_running_requests_releases_blocks():
    sched, kv = make_scheduler(8, max_num_seqs=1)
    a = make_seq("a", range(1, 10), max_tokens=5)
    b = make_seq("b", range(1, 10), max_tokens=5)
    sched.add(a)
    sched.add(b)
    sim = Sim(sched, kv)
    sim.step()
    assert sched.running == [a] and sched.waiting == [b]
    sched.remove(b)  # abort while waiting
    assert sched.waiting == []
    sched.remove(a)  # abort while running
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == 8
    assert kv.pool.num_cached_free == 2  # a's full blocks stay reusable
    kv.pool.check_integrity()


def make_policy_scheduler(policy, max_bypass=32, budget=64):
    cfg = EngineConfig(
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=budget,
        scheduling=policy,
        max_bypass=max_bypass,
    )
    kv = KVCacheManager(256, 4, True)
    return Scheduler(cfg, kv), kv


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="scheduling must be one of cache-aware, fcfs, got 'lifo'"):
        make_policy_scheduler("lifo")


@pytest.mark.parametrize("policy", ["cache-aware", "fcfs"])
def test_cache_aware_admits_cached_course_students_first(policy):
    sched, kv = make_policy_scheduler(policy, budget=20)
    course_a, course_b = list(range(100, 132)), list(range(200, 232))  # 8 blocks each
    sim = Sim(sched, kv)
    sched.add(make_seq("a0", [*course_a, 1, 2]))
    while not any(s.request_id == "a0" and s.num_computed_tokens >= 32 for s in sched.running):
        sim.step()
    # A new course arrives before more students of the cached course.
    for rid, toks in [("b0", [*course_b, 3]), ("a1", [*course_a, 4, 5]), ("a2", [*course_a, 6])]:
        sched.add(make_seq(rid, toks))
    out = sched.schedule()
    admitted = {s.request_id: n for s, n in zip(out.seqs, out.num_tokens, strict=True)}
    if policy == "cache-aware":
        # The cheap cached students start at once; the new course takes what budget is left.
        assert admitted["a1"] == 2 and admitted["a2"] == 1
        assert {s.request_id: s.num_cached_tokens for s in out.seqs}["a1"] == 32
        assert admitted["b0"] == 20 - sum(n for r, n in admitted.items() if r != "b0")
    else:
        assert "b0" in admitted and "a1" not in admitted and "a2" not in admitted


def test_cache_aware_bypass_is_bounded():
    sched, kv = make_policy_scheduler("cache-aware", max_bypass=3, budget=8)
    course = list(range(100, 132))
    sim = Sim(sched, kv)
    sched.add(make_seq("warm", [*course, 1], max_tokens=1))
    sim.run()
    cold = make_seq("cold", list(range(300, 340)), max_tokens=1)  # no hits, arrives first
    sched.add(cold)
    for i in range(12):  # students with a cached prefix, all behind it
        sched.add(make_seq(f"s{i}", [*course, 10 + i], max_tokens=1))
    sim.run()
    order = [rid for _, rid in sim.admissions if rid != "warm"]
    assert order.index("cold") == 3  # passed over exactly max_bypass times, then first
    assert cold.num_bypassed == 3
    assert sorted(order) == sorted(["cold", *(f"s{i}" for i in range(12))])
