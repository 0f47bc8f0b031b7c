"""The cluster: routing policies on their own, and `tutorserve serve --replicas 2` on Ray Serve
with the openai client (Ray is started and stopped by the server under test)."""

import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from conftest import start_server
from tutorserve.cluster.front import combine
from tutorserve.cluster.routing import (
    CacheAware,
    Candidate,
    LeastLoaded,
    RoundRobin,
    RouteRequest,
    SessionAffinity,
    policy_named,
)
from tutorserve.engine.stats import EngineStats, SpecCounters, TierSnapshot

A, B = "replica-a", "replica-b"


def cands(load_a=0, load_b=0):
    return [Candidate(A, load_a), Candidate(B, load_b)]


def first(groups):
    return groups[0][0]


def test_round_robin_takes_turns_and_least_loaded_the_idlest():
    rr = RoundRobin()
    assert [first(rr.rank(cands(), RouteRequest())) for _ in range(4)] == [A, B, A, B]
    assert first(LeastLoaded().rank(cands(3, 1), RouteRequest())) == B
    assert sorted(r for g in rr.rank(cands(), RouteRequest()) for r in g) == [A, B]


def test_a_session_sticks_to_its_replica_while_it_lives():
    policy = SessionAffinity()
    req = RouteRequest(session_id="s1")
    assert first(policy.rank(cands(0, 1), req)) == A
    policy.routed(req, A)
    assert first(policy.rank(cands(5, 0), req)) == A  # busier, but it holds the history
    policy.forget({B})  # A left: the session goes where the load says
    assert first(policy.rank([Candidate(B, 0)], req)) == B


def test_cache_aware_follows_the_longest_prefix_within_the_balance():
    policy = CacheAware(balance=2)
    course = [b"h1", b"h2", b"h3"]
    policy.routed(RouteRequest(course), B)
    policy.routed(RouteRequest([b"h1", b"x2"]), A)  # shares only the first block
    student = RouteRequest([*course, b"s9"])
    assert first(policy.rank(cands(0, 2), student)) == B  # the course's replica, 2 busier
    assert first(policy.rank(cands(0, 3), student)) == A  # past the balance: the idlest
    assert first(policy.rank(cands(1, 0), RouteRequest([b"zz"]))) == B  # unknown: idlest
    policy.forget({A})
    assert first(policy.rank([Candidate(A, 0)], student)) == A


def test_an_adapter_request_prefers_a_replica_holding_the_adapter():
    reps = [Candidate(A, 0), Candidate(B, 2, frozenset({"algebra-tutor"}))]
    for policy in (SessionAffinity(), CacheAware()):
        assert first(policy.rank(reps, RouteRequest(lora="algebra-tutor"))) == B
        assert first(policy.rank(reps, RouteRequest(lora="other"))) == A  # nobody has it
        assert first(policy.rank(reps, RouteRequest())) == A
    cache = CacheAware()
    cache.routed(RouteRequest([b"c1"]), A)  # the cached course outweighs the adapter
    assert first(cache.rank(reps, RouteRequest([b"c1"], lora="algebra-tutor"))) == A


def test_policies_are_named_once():
    assert isinstance(policy_named("cache-aware"), CacheAware)
    with pytest.raises(ValueError, match="routing must be one of"):
        policy_named("random")


def test_cluster_stats_are_the_replicas_summed():
    tier = TierSnapshot("ram", 1, 2, 3, 4, 0, 0, 1, 0.5, 10, 100, 2)
    a = EngineStats(1, 2, 10, 4, 6, 3, 100, 40, 0, (tier,), SpecCounters(1, 4, [1, 1]))
    b = EngineStats(2, 0, 10, 1, 9, 5, 50, 10, 1, (tier,), SpecCounters(2, 8, [2]))
    total = combine([a, b])
    assert (total.num_running, total.kv_blocks, total.prefix_hit_tokens) == (3, 20, 50)
    assert total.tiers[0].hits == 2 and total.tiers[0].load_seconds == 1.0
    assert total.spec.accepted_per_position == [3, 1]


COURSE = "You are a patient tutor for fractions; ask one question at a time. " * 12


def _cached(client, prompt):
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    return out.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def cluster(synth_llama):
    server = start_server(synth_llama, "--replicas", "2", "--routing", "cache-aware")
    yield server
    server.stop()


def test_the_cluster_serves_the_openai_api_and_routes_by_cached_prefix(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
        stream=True, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Students of one course: after the first, each lands where the course prompt is cached.
    assert _cached(client, COURSE + "Student 0: what is a half?") == 0
    hits = [_cached(client, COURSE + f"Student {i}: what is a third?") for i in range(1, 5)]
    assert min(hits) >= 16 * 10, hits
    # A student's session: each turn carries the last, and finds it cached.
    history = "Student 7 works on 3/4 + 1/8. " * 8
    for turn in range(3):
        out = client.completions.create(model="tiny", prompt=history, max_tokens=4,
                                        extra_body={"session_id": "student-7"})  # fmt: skip
        if turn:
            assert out.usage.prompt_tokens_details.cached_tokens >= 16 * 4
        history += out.choices[0].text + f" Turn {turn}: next step? " * 4
    running = [v for k, v in cluster.metrics().items() if "num_requests_running{replica=" in k]
    assert len(running) == 2 and sum(running) == 0  # one series per replica


def test_round_robin_spreads_a_course_over_the_replicas(synth_llama):
    server = start_server(synth_llama, "--replicas", "2", "--routing", "round-robin")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        hits = [_cached(client, COURSE + f"Student {i}: what is a quarter?") for i in range(4)]
    finally:
        server.stop()
    # One replica computed the course, then the other; after that, each has it cached.
    assert hits[:2] == [0, 0] and min(hits[2:]) >= 16 * 10, hits


def _replica_pids(root: int) -> list[int]:
    """The engine replicas of the server process `root` (Ray's processes are its descendants;
    another test's cluster may be running beside it)."""
    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True,
                          text=True).stdout.splitlines()  # fmt: skip
    procs = [(int(pid), int(ppid), " ".join(args)) for pid, ppid, *args in map(str.split, rows)]
    family, grew = {root}, True
    while grew:
        more = {pid for pid, ppid, _ in procs if ppid in family} - family
        family |= more
        grew = bool(more)
    return [pid for pid, _, args in procs if pid in family and "ServeReplica:tutorserve" in args]


def test_a_replica_killed_mid_stream_ends_its_streams_and_the_cluster_goes_on(synth_llama):
    server = start_server(synth_llama, "--replicas", "2", "--routing", "least-loaded")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        ends, streaming = {}, [threading.Event(), threading.Event()]

        def stream(i):
            try:
                got = client.completions.create(
                    model="tiny", prompt=f"Student {i} " * 4, max_tokens=2000, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                reasons = []
                for c in got:
                    streaming[i].set()
                    reasons += [c.choices[0].finish_reason] if c.choices else []
                ends[i] = reasons[-1]
            except Exception as e:  # an error event ends the stream: the client raises it
                ends[i] = f"error: {e}"

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        threads[0].start()
        assert streaming[0].wait(30)
        threads[1].start()  # least-loaded: on the other replica
        assert streaming[1].wait(30)
        pids = _replica_pids(server.proc.pid)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        assert sorted(ends) == [0, 1]
        assert any(str(e).startswith("error") for e in ends.values()), ends
        # The other replica serves on at once; Serve brings the dead one back.
        deadline = time.monotonic() + 60
        while True:
            try:
                out = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
                assert out.usage.completion_tokens == 2
                break
            except openai.APIStatusError as e:
                assert e.status_code == 503 and time.monotonic() < deadline, e
                time.sleep(1)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
