"""The cluster: routing policies on their own, and `tutorserve serve --replicas 2` on Ray Serve
with the openai client (Ray is started and stopped by the server under test; for the replica
kill, the server runs in this process, which then drives Ray)."""

import threading
import time
from collections import Counter

import httpx
import openai
import pytest

from conftest import _free_port, start_server
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


def test_cache_aware_spreads_new_prompts_over_the_pools_within_the_balance():
    """At low load both replicas are idle whenever a new course comes: by load alone every
    course would go to the same one. Sent to the replica sent fewer blocks, eleven courses of
    four blocks split six and five."""
    policy = CacheAware(balance=4)
    placed = Counter()
    for c in range(11):
        course = RouteRequest([f"c{c}-{i}".encode() for i in range(4)])
        replica = first(policy.rank(cands(0, 0), course))
        policy.routed(course, replica)
        placed[replica] += 1
    assert placed == {A: 6, B: 5}
    assert first(policy.rank(cands(0, 3), RouteRequest([b"new"]))) == B  # fewer blocks
    assert first(policy.rank(cands(0, 5), RouteRequest([b"new"]))) == A  # past the balance
    policy.routed(RouteRequest([b"c0-0", b"c1-0", b"c2-0"]), B)  # three of A's 24 blocks move
    assert first(policy.rank(cands(0, 0), RouteRequest([b"new"]))) == A  # 21 against 23
    policy.forget({A})
    assert first(policy.rank([Candidate(A, 0)], RouteRequest([b"new"]))) == A


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
    total = EngineStats.sum([a, b])
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


class InProcessCluster:
    """`serve --replicas 2` in this process (uvicorn on a thread), so the test drives Ray:
    it asks each replica for its counters and kills one with `ray.kill`."""

    def __init__(self, model, kv_dir, routing):
        import uvicorn

        from tutorserve.cli import _cluster_front, build_parser
        from tutorserve.cluster.scaling import scale_from_args
        from tutorserve.config import EngineConfig, engine_options
        from tutorserve.server.app import ServerSettings, build_app

        a = build_parser().parse_args([
            "serve", "--model", model, "--replicas", "2", "--routing", routing, "--no-tutor",
            "--num-kv-blocks", "2048", "--dtype", "float32", "--kv-disk-dir", str(kv_dir),
        ])  # fmt: skip
        config = EngineConfig.from_kwargs(**engine_options(a))
        self.front = _cluster_front(a, config, scale_from_args(a, batch=a.max_num_seqs))
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(build_app(self.front, ServerSettings("tiny")), port=port,
                                log_level="warning")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.1)

    def replica_stats(self):
        got = self.front.handle.broadcast("stats").results(timeout_s=30, return_exceptions=True)
        return {rid: stats for rid, stats, _ in (r for r in got if isinstance(r, tuple))}

    def kill(self, replica):
        import ray

        from tutorserve.cluster.launch import APP

        name = f"SERVE_REPLICA::{APP}#engine#{replica}"
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def stop(self):
        self.server.should_exit = True  # its shutdown stops Serve and Ray
        self.thread.join(timeout=60)
        if self.thread.is_alive():
            self.front._shutdown()


def disk_hits(stats):
    return sum(t.hits for t in stats.tiers if t.name == "disk")


def test_a_killed_replicas_streams_continue_elsewhere_and_its_session_resumes_from_the_shared_tier(
    synth_llama, tmp_path
):
    from tutorserve import LLM, SamplingParams

    single = LLM(synth_llama, dtype="float32", enable_prefix_caching=False, kv_ram_bytes=0)

    def expected(prompt, **params):
        ids = single.tokenizer.encode(prompt)
        params = SamplingParams(temperature=0, **{"max_tokens": 8} | params)
        return single.generate([ids], params)[0].text

    cluster = InProcessCluster(synth_llama, tmp_path / "kv", routing="session")
    try:
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)  # fmt: skip

        def turn(prompt):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                             temperature=0,
                                             extra_body={"session_id": "student-9"})  # fmt: skip

        history = "Student 9 works on 2/3 + 1/6. " * 8
        first_turn = turn(history)
        assert first_turn.choices[0].text == expected(history)
        owner = [r for r, s in cluster.replica_stats().items() if s.prefix_query_tokens]
        assert len(owner) == 1, owner  # the replica that holds the session
        # Written through as the turn ended, though the replica stays busy from here on.
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("kv/*/*.kvb"))) < 64 // 16:
            assert time.monotonic() < deadline, "the session's blocks never reached disk"
            time.sleep(0.2)

        texts, ends, streaming = {}, {}, [threading.Event(), threading.Event()]

        def stream(i):
            try:
                got = client.completions.create(
                    model="tiny", prompt=f"Student {i} " * 4, max_tokens=2000, stream=True,
                    temperature=0, extra_body={"ignore_eos": True},
                )  # fmt: skip
                reasons, text = [], ""
                for c in got:
                    streaming[i].set()
                    text += c.choices[0].text if c.choices else ""
                    reasons += [c.choices[0].finish_reason] if c.choices else []
                texts[i], ends[i] = text, reasons[-1]
            except Exception as e:  # an error event ends the stream: the client raises it
                ends[i] = f"error: {e}"
            finally:
                streaming[i].set()

        # One stream on each replica (the least loaded takes a request without a session).
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for i, t in enumerate(threads):
            t.start()
            assert streaming[i].wait(60)
        cluster.kill(owner[0])
        for t in threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        # The stream on the dead replica went on from its tokens on the other one, greedy,
        # so both have what one engine gives.
        assert ends == {0: "length", 1: "length"}, ends
        assert cluster.front.resumed >= 1
        for i in range(2):
            assert texts[i] == expected(f"Student {i} " * 4, max_tokens=2000, ignore_eos=True)

        # The next turn goes elsewhere and finds the session's history in the shared folder.
        second = history + first_turn.choices[0].text + " Turn 1: and 1/2 + 1/3? " * 2
        second_turn = turn(second)  # sent elsewhere even if first routed to the dead replica
        assert second_turn.usage.prompt_tokens_details.cached_tokens >= 64
        assert second_turn.choices[0].text == expected(second)
        served = [r for r, s in cluster.replica_stats().items() if disk_hits(s)]
        assert served and owner[0] not in served, (owner, served)
        assert httpx.get(cluster.url + "/health").status_code == 200
    finally:
        cluster.stop()
