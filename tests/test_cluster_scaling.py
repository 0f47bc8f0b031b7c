"""An elastic cluster: the scaling options and Ray Serve's autoscaling config they make, each
replica's metrics and health, runtime adapters on a replica that starts later, and adapter-aware
routing between live replicas (`tutorserve serve --min-replicas 1 --max-replicas 2`)."""

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray.serve.config import AutoscalingConfig

from conftest import start_server
from tutorserve.cli import build_parser, main
from tutorserve.cluster.scaling import Scale, scale_from_args
from tutorserve.engine.stats import EngineStats, SpecCounters, TierSnapshot
from tutorserve.lora.synth import synth_lora
from tutorserve.models.loader import load_model_config
from tutorserve.server.metrics import EngineMetrics


def scale(*args):
    a = build_parser().parse_args(["serve", *args])
    return scale_from_args(a, batch=a.max_num_seqs)


def test_scaling_options_make_serves_autoscaling_config():
    assert scale() is None
    assert scale("--replicas", "3") == Scale(3, 3)
    assert Scale(3, 3).deployment_options() == {"num_replicas": 3}
    elastic = scale("--max-replicas", "4", "--max-num-seqs", "16")
    assert elastic == Scale(1, 4, 16)  # the target defaults to one engine batch
    config = scale("--min-replicas", "2", "--max-replicas", "4", "--target-ongoing-requests",
                   "6").deployment_options()["autoscaling_config"]  # fmt: skip
    checked = AutoscalingConfig(**config)  # Serve's own model accepts every key
    assert (checked.min_replicas, checked.initial_replicas, checked.max_replicas) == (2, 2, 4)
    assert checked.target_ongoing_requests == 6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "2", "--max-replicas", "3"], "not both"),
        (["--min-replicas", "2"], "needs --max-replicas"),
        (["--target-ongoing-requests", "4"], "needs --max-replicas"),
        (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas <= --max-replicas"),
        (["--min-replicas", "0", "--max-replicas", "2"], "--min-replicas <= --max-replicas"),
        (["--max-replicas", "2", "--target-ongoing-requests", "0"], "must be positive"),
        (["--replicas", "-1"], "at least 1"),
    ],
)
def test_contradicting_scaling_options_are_a_usage_error(args, message, capsys):
    # Checked before the model loads: the model named here does not exist.
    assert main(["serve", "--model", "/nonexistent", "--no-tutor", *args]) == 2
    assert message in capsys.readouterr().err


def _samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def test_cluster_metrics_carry_replica_and_role_labels_and_one_engine_none():
    tier = TierSnapshot("ram", 1, 2, 3, 4, 0, 0, 1, 0.5, 10, 100, 2)
    a = EngineStats(1, 2, 10, 4, 6, 3, 100, 40, 0, (tier,), SpecCounters(1, 4, [1]))
    b = EngineStats(0, 1, 10, 0, 10, 0, 30, 0, 2, (), SpecCounters())
    per_replica = {("r-a", "prefill"): a, ("r-b", "decode"): b}
    cluster = _samples(EngineMetrics(lambda: a, lambda: per_replica).render().decode())
    ra, rb = (("replica", "r-a"), ("role", "prefill")), (("replica", "r-b"), ("role", "decode"))
    assert cluster[("tutorserve:num_requests_waiting", rb)] == 1
    assert cluster[("tutorserve:prefix_cache_queries_total", ra)] == 100
    assert cluster[("tutorserve:kv_cache_blocks", (*ra, ("state", "used")))] == 4
    assert cluster[("tutorserve:kv_tier_hits_total", (*ra, ("tier", "ram")))] == 1
    # Engine-state samples are those a cluster without replicas lacks; all carry the labels.
    no_replicas = {name for name, _ in _samples(EngineMetrics(lambda: a, dict).render().decode())}
    engine = [dict(labels) for name, labels in cluster if name not in no_replicas]
    assert len(engine) > 20
    assert all((x["replica"], x["role"]) in per_replica for x in engine)
    single = _samples(EngineMetrics(lambda: a).render().decode())
    assert single[("tutorserve:num_requests_waiting", ())] == 2
    assert not any("replica" in dict(labels) for _, labels in single)


# ---- live: one replica, an adapter loaded at run time, scaled to two under load -------------
def _health(server):
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["cluster"]


def _queries(server):
    """Prompt tokens each replica looked up in its prefix cache, by replica id."""
    return {dict(labels)["replica"]: v for (name, labels), v in
            _samples(httpx.get(server.url + "/metrics", timeout=10).text).items()
            if name == "tutorserve:prefix_cache_queries_total"}  # fmt: skip


def _complete(server, model, prompt, max_tokens=4):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text


def _wait(what, check, timeout):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(1)
    return got


@pytest.fixture(scope="module")
def adapter(synth_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling-lora")
    return str(synth_lora(root / "algebra", load_model_config(synth_llama), 8, seed=0))


@pytest.fixture(scope="module")
def elastic(synth_llama):
    server = start_server(synth_llama, "--min-replicas", "1", "--max-replicas", "2",
                          "--target-ongoing-requests", "1", "--routing", "session",
                          "--enable-lora", "--max-loras", "1", "--no-tutor")  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scaled(elastic, adapter, tmp_path_factory):
    """The cluster after it scaled from one replica to two under load, with an adapter loaded
    at run time while one was up: (the first replica's id, /health's replicas after)."""
    first = _health(elastic)
    assert len(first["replicas"]) == 1 and first["serve_replica_states"] == {"RUNNING": 1}
    [old] = first["replicas"]
    load = httpx.post(elastic.url + "/v1/load_lora_adapter", timeout=120,
                      json={"lora_name": "algebra", "lora_path": adapter})  # fmt: skip
    assert load.status_code == 200, load.text
    empty = str(tmp_path_factory.mktemp("not-an-adapter"))
    bad = httpx.post(elastic.url + "/v1/load_lora_adapter", timeout=120,
                     json={"lora_name": "broken", "lora_path": empty})  # fmt: skip
    assert bad.status_code == 400  # and not registered: a new replica would fail to load it
    _wait(
        "the adapter in the replica's report",
        lambda: _health(elastic)["replicas"][old]["adapters"] == ["algebra"],
        30,
    )

    # Three requests at a time against a target of one per replica: Serve adds the second.
    stop = threading.Event()

    def busy(i):
        while not stop.is_set():
            _complete(elastic, "tiny", f"Student {i} asks about fractions. " * 3, 200)

    threads = [threading.Thread(target=busy, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    try:
        replicas = _wait("a second replica", lambda: len(
            (h := _health(elastic))["replicas"]) == 2 and h["replicas"], 240)  # fmt: skip
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    return old, replicas


def test_an_elastic_cluster_scales_up_and_its_new_replica_has_the_runtime_adapters(elastic, scaled):
    old, replicas = scaled
    [new] = set(replicas) - {old}
    assert replicas[new]["adapters"] == ["algebra"]  # from the registry, not the broadcast
    assert _health(elastic)["serve_replica_states"] == {"RUNNING": 2}
    running = _samples(httpx.get(elastic.url + "/metrics", timeout=10).text)
    assert {dict(labels)["replica"] for (name, labels) in running
            if name == "tutorserve:num_requests_running"} == {old, new}  # fmt: skip


def test_an_adapter_request_prefers_the_replica_holding_the_adapter(elastic, scaled):
    """Both replicas have the adapter loaded; neither has it in its one slot yet."""
    _, replicas = scaled
    _wait(
        "the load to end",
        lambda: all(
            r["running"] == r["waiting"] == 0 for r in _health(elastic)["replicas"].values()
        ),
        120,
    )
    before = _queries(elastic)
    _complete(elastic, "algebra", "Solve 2x + 3 = 7.")  # into a slot on one replica
    holder = _wait("the adapter's replica", lambda: [r for r, n in _queries(elastic).items()
                                                     if n > before.get(r, 0)], 30)[0]  # fmt: skip
    [other] = set(replicas) - {holder}
    time.sleep(5)  # the replicas report their slots to Serve's router every 2 s
    # A long request with the adapter keeps its replica busier than the other ...
    long = threading.Thread(target=_complete, args=(elastic, "algebra", "Explain 3/4. " * 4, 1900))
    long.start()
    _wait("the long request running", lambda: _health(elastic)["replicas"][holder]["running"], 30)
    before = _queries(elastic)
    # ... yet the next adapter request goes there too: least-loaded alone would pick the other.
    _complete(elastic, "algebra", "Now solve 5x - 2 = 8.")
    assert long.is_alive()  # so the holder was the busier replica when this one was routed
    after = _wait(
        "the request in the metrics",
        lambda: sum((q := _queries(elastic)).values()) > sum(before.values()) and q,
        30,
    )
    assert after[holder] > before[holder] and after[other] == before[other], (before, after)
    long.join(timeout=120)
    assert not long.is_alive()
