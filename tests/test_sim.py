"""The simulator's pieces against hand-computed cases, the step-cost fit against known
coefficients, and the planner's KV formula against the engine's own block accounting."""

import gzip
import itertools
import json
import math
import random
from dataclasses import asdict

import numpy as np
import pytest

from tutorserve.bench.serving_metrics import SLO
from tutorserve.bench.step_cost import FEATURES, StepCostModel, features, fit_nonnegative
from tutorserve.cli import main
from tutorserve.cluster.routing import policy_named
from tutorserve.config import EngineConfig
from tutorserve.engine.engine import LLMEngine
from tutorserve.engine.scheduler import StepShape
from tutorserve.models.loader import load_model_config
from tutorserve.sim.planner import POLICIES, Planner, kv_wall
from tutorserve.sim.replica import ReplicaSpec, SimReplica
from tutorserve.sim.setup import Deployment
from tutorserve.sim.simulator import ClientRun, SimResult, SimSession, SimTurn, Simulation
from tutorserve.sim.workload import Cohort

CONST, PER_TOKEN = 0.010, 0.001  # seconds: a step costs 10 ms plus 1 ms per token


def _cost(**coef: float) -> StepCostModel:
    values = {"const": CONST, "tokens": PER_TOKEN} | coef
    return StepCostModel([values.get(f, 0.0) for f in FEATURES], True, "test")


def _sim(n=1, blocks=64, routing="round-robin", **spec) -> Simulation:
    spec = ReplicaSpec(num_kv_blocks=blocks, **spec)
    return Simulation([SimReplica(f"r{i}", spec, _cost(), 1000) for i in range(n)],
                      policy_named(routing))  # fmt: skip


def _one_turn(tokens, max_tokens, start, course=0):
    return SimSession([SimTurn(tokens, max_tokens)], start, course)


def test_one_request_alone():
    # 100-token prompt in one step (0.010 + 0.100 s), then 4 decode steps of 0.011 s.
    (req,) = _sim().run([_one_turn(list(range(100)), 5, 2.0)]).requests
    assert req.first_token == pytest.approx(2.0 + 0.110)
    assert req.finish == pytest.approx(2.0 + 0.110 + 4 * 0.011)


def test_one_request_chunked_prefill():
    # A 64-token budget: the prompt takes chunks of 64 and 36 tokens (0.074 + 0.046 s).
    (req,) = _sim(max_num_batched_tokens=64).run([_one_turn(list(range(100)), 1, 0.0)]).requests
    assert req.first_token == pytest.approx(0.074 + 0.046)
    assert req.finish == req.first_token


def test_a_replica_steps_slower_while_another_one_steps():
    # Two replicas on one host, a step 1.5× as long when it starts beside the other's: b's
    # 100-token prefill starts at 0.05 s, inside a's (0 to 0.11 s); a's started alone.
    sim = _sim(n=2)
    for r in sim.replicas:
        r.cost.sibling_busy_factor = 1.5
    a, b = sim.run([_one_turn(list(range(100)), 1, 0.0),
                    _one_turn(list(range(200, 300)), 1, 0.05)]).requests  # fmt: skip
    assert a.first_token == pytest.approx(0.110)
    assert b.first_token - b.arrival == pytest.approx(0.110 * 1.5)


def test_two_requests_sharing_a_prefix():
    shared = list(range(64))  # 4 full blocks
    sim = _sim()
    a, b = sim.run([
        _one_turn([*shared, *range(500, 516)], 2, 0.0),
        _one_turn([*shared, *range(600, 616)], 2, 1.0),
    ]).requests  # fmt: skip
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 64
    # b computes only its own 16 tokens: 0.010 + 0.016 s to its first token.
    assert b.first_token - b.arrival == pytest.approx(0.026)
    kv = sim.replicas[0].kv
    assert kv.prefix_hit_tokens / kv.prefix_query_tokens == pytest.approx(64 / 160)


def test_arrivals_during_a_prefill_wait_for_its_prefix():
    # Both arrive at once: the second waits a step for the first's prompt (cache-aware
    # admission, as the engine does) and then hits it instead of computing it twice.
    shared = list(range(64))
    a, b = _sim().run([
        _one_turn([*shared, 900], 2, 0.0),
        _one_turn([*shared, 901], 2, 0.0),
    ]).requests  # fmt: skip
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 64)


def test_a_preemption_recomputes_and_loses_nothing():
    # 10 blocks of 16 tokens; two 64-token prompts decoding 40 tokens need 7 blocks each.
    sim = _sim(blocks=10)
    a, b = sim.run([
        _one_turn(list(range(64)), 40, 0.0),
        _one_turn(list(range(100, 164)), 40, 0.0),
    ]).requests  # fmt: skip
    assert sim.replicas[0].scheduler.num_preemptions >= 1
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)  # the later arrival is the victim
    assert a.finish < b.finish and len(b.output) == 40
    pool = sim.replicas[0].kv.pool
    assert pool.num_free == pool.num_blocks  # every block back


def test_session_turns_follow_think_time_and_hit_their_history():
    turns = [SimTurn(list(range(40)), 8), SimTurn([7, 8, 9], 4, think_time_s=5.0)]
    first, second = _sim().run([SimSession(turns, 0.0)]).requests
    assert second.arrival == pytest.approx(first.finish + 5.0)
    assert second.prompt == first.prompt + first.output + [7, 8, 9]
    # 48 tokens, but the last reply token's KV is never computed: 47 → 2 full blocks.
    assert second.num_cached_tokens == 32


@pytest.mark.parametrize("routing", ["round-robin", "cache-aware"])
def test_routing_policies_place_courses(routing):
    courses = [[c * 1000 + i for i in range(64)] for c in range(2)]
    sessions = [_one_turn([*courses[i % 2], 5000 + i], 2, i * 1.0, i % 2) for i in range(6)]
    sim = _sim(n=2, routing=routing)
    sim.run(sessions)
    hits = sum(r.kv.prefix_hit_tokens for r in sim.replicas)
    # Cache-aware keeps each course on one replica: every student after a course's first hits;
    # round-robin alternates, so course 0 always lands on r0 and course 1 on r1 as well here.
    assert hits == 4 * 64


def test_round_robin_splits_a_course_that_cache_aware_keeps():
    course = list(range(64))
    sessions = [_one_turn([*course, 5000 + i], 2, i * 1.0) for i in range(4)]
    hits = {}
    for routing in ("round-robin", "cache-aware"):
        sim = _sim(n=2, routing=routing)
        sim.run(sessions)
        hits[routing] = sum(r.kv.prefix_hit_tokens for r in sim.replicas)
    assert hits == {"round-robin": 2 * 64, "cache-aware": 3 * 64}


def test_an_earlier_run_leaves_its_caches_and_routing_but_not_its_counts():
    """A run replayed after what its server served before (`sim validate`): a course an earlier
    run sent is still cached on the replica the router placed it on; the counts are the run's."""
    course = list(range(64))
    earlier = ClientRun([_one_turn([*course, 9000 + i], 2, 0.0) for i in range(2)])
    run = [_one_turn([*course, 5000], 2, 0.0)]
    blank, after = _sim(n=2, routing="cache-aware"), _sim(n=2, routing="cache-aware")
    (cold,) = blank.run(run).requests
    result = after.run(run, earlier=[earlier])
    (warm,) = result.requests
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 64)
    summary = result.summary(SLO())
    assert summary["prefix_cache_hit_rate"] == pytest.approx(64 / 65)  # this run's query only
    assert sum(r.num_steps for r in after.replicas) == sum(r.num_steps for r in blank.replicas)
    assert warm.arrival > 0, "the run starts after the earlier one ended"


def test_a_capped_client_sends_a_turn_only_when_one_ends():
    sim = _sim(n=1)
    result = SimResult([], sim.replicas)
    sessions = [_one_turn([100 * i + t for t in range(20)], 3, 0.0) for i in range(3)]
    sim._serve(ClientRun(sessions, max_concurrency=1), "", 0.0, result)

    def one_at_a_time(requests) -> bool:
        done = sorted(requests, key=lambda r: r.first_token)
        return all(b.first_token > a.finish for a, b in itertools.pairwise(done))

    assert len(result.requests) == 3 and one_at_a_time(result.requests)
    assert not one_at_a_time(_sim(n=1).run(sessions).requests), "uncapped, they overlap"


def test_a_runs_earlier_runs_are_recorded_or_taken_from_the_runs_beside_it(tmp_path):
    from tutorserve.bench.compare import cohort_of, warmup_cohort
    from tutorserve.sim.validate import served_before

    def config(system: str, seed: int, **more) -> dict:
        return {"system": system, "workload": "edu-multiturn", "num_requests": 8,
                "request_rate": seed / 10, "burstiness": 1.0, "arrival": "gamma", "seed": seed,
                "max_concurrency": None, **more}  # fmt: skip

    for system, seed in (("x", 5), ("x", 6), ("x", 7), ("y", 4)):
        path = tmp_path / f"{system}-{seed}.json"
        path.write_text(json.dumps({"config": config(system, seed)}))
    run = json.loads((tmp_path / "x-7.json").read_text())
    assert served_before(tmp_path / "x-7.json", run) == [
        warmup_cohort(run["config"]),
        cohort_of(config("x", 5)),
        cohort_of(config("x", 6)),
    ]
    recorded = {"config": config("x", 7, served_before=[cohort_of(config("y", 4))])}
    assert served_before(tmp_path / "x-7.json", recorded) == [cohort_of(config("y", 4))]
    plain = {k: v for k, v in config("x", 7).items() if k != "system"}  # a `bench serve` run
    assert served_before(tmp_path / "x-7.json", {"config": plain}) == []


def test_ram_tier_brings_back_an_evicted_history_for_its_copy_time():
    # A 6-block pool: the second session's prompt evicts the first's history, which the next
    # turn of the first finds in the RAM tier (4 blocks restored at 5 ms each, in its step).
    cost = _cost()
    cost.restore_s_per_block = 0.005
    spec = ReplicaSpec(num_kv_blocks=6, ram_tier_blocks=64)
    sim = Simulation([SimReplica("r0", spec, cost, 1000)], policy_named("round-robin"))
    first = SimSession([SimTurn(list(range(70)), 2), SimTurn([1, 2], 2, think_time_s=10.0)], 0.0)
    other = SimSession([SimTurn(list(range(500, 580)), 2)], 1.0)
    _, _, turn2 = sorted(sim.run([first, other]).requests, key=lambda r: r.arrival)
    assert turn2.num_cached_tokens == 64
    # Its prompt is 70 + 2 reply + 2 new tokens: its step computes 74 − 64 = 10, copies 4 blocks.
    assert turn2.first_token - turn2.arrival == pytest.approx(0.010 + 0.010 + 4 * 0.005)
    assert sim.replicas[0].tier.hits == 4


def test_prefill_decode_split_hands_the_kv_over():
    # P prefills 100 tokens (0.110 s) and samples the first token; the KV (100 tokens at 1 ms
    # each) reaches D at 0.210, which restores its 6 full blocks (2 ms each), computes the other
    # 101 − 96 = 5 tokens (0.015 s) and samples; 3 decode steps of 0.011 s finish the reply.
    cost = _cost()
    cost.restore_s_per_block = 0.002
    d = Deployment(2, "round-robin", ReplicaSpec(num_kv_blocks=64), prefill=1,
                   transfer_s_per_token=0.001)  # fmt: skip
    sim = d.simulation(cost, 1000)
    (req,) = sim.run([_one_turn(list(range(100)), 5, 0.0)]).requests
    assert req.first_token == pytest.approx(0.110)
    assert req.finish == pytest.approx(0.210 + 0.015 + 6 * 0.002 + 3 * 0.011)
    assert len(req.output) == 5
    prefill, decode = sim.replicas[0], sim.decode[0]
    assert prefill.num_steps == 1 and decode.num_steps == 4
    assert decode.tier.hits == 6


def test_summary_matches_the_benchmark_definitions():
    result = _sim().run([_one_turn(list(range(100)), 5, 0.0)])
    s = result.summary(SLO(ttft_ms=200, tpot_ms=10))
    assert s["p50_ttft_ms"] == pytest.approx(110)
    assert s["mean_tpot_ms"] == pytest.approx(11)
    assert s["goodput"] == 0  # TPOT 11 ms misses a 10 ms SLO
    assert s["completed"] == 1 and s["rejected"] == 0


def test_a_prompt_beyond_the_pool_is_rejected_not_simulated():
    result = _sim(blocks=4).run([_one_turn(list(range(100)), 5, 0.0)])
    assert result.rejected == 1 and not result.requests


def test_step_cost_fit_recovers_known_coefficients():
    rng = random.Random(0)
    truth = np.array([0.02, 5e-4, 1e-3, 2e-6, 3e-8, 0.0, 0.0, 0.03])
    shapes = [
        StepShape(tuple((rng.choice([1, 1, rng.randint(2, 300)]), rng.randint(0, 2000))
                        for _ in range(rng.randint(1, 40))))
        for _ in range(300)
    ]  # fmt: skip
    x = np.array([features(s, dequant_rows=64) for s in shapes])
    assert 0 < x[:, -1].sum() < len(shapes)  # both kinds of step are there to fit
    assert fit_nonnegative(x, x @ truth) == pytest.approx(truth)


def test_step_cost_fit_keeps_coefficients_nonnegative():
    x = np.array([[1.0, t] for t in range(1, 20)])
    y = 0.05 - 0.001 * x[:, 1]  # falls with tokens: a negative slope would fit best
    assert (fit_nonnegative(x, y) >= 0).all()


def test_features_by_hand():
    shape = StepShape(((1, 99), (1, 9), (10, 20)), num_adapters=1, lora_tokens=10)
    assert features(shape) == [1.0, 12, 3, 100 + 10, 10 * (20 + 5), 1, 10, 0.0]
    # Twelve tokens: dequantized above 11 rows, multiplied on the blocks up to 12.
    assert features(shape, dequant_rows=11)[-1] == 1.0
    assert features(shape, dequant_rows=12)[-1] == 0.0


def test_a_model_saved_before_a_feature_existed_predicts_as_it_did(tmp_path):
    old = _cost(rows=0.002, dequant_steps=0.5)
    old.coef = old.coef[:-1]  # as saved when "dequant_steps" did not exist yet
    old.dequant_rows = 0  # every step would pay the new feature, were it there
    data = json.loads(json.dumps({"features": FEATURES[:-1], **asdict(old)}))
    (tmp_path / "old.json").write_text(json.dumps(data))
    loaded = StepCostModel.load(tmp_path / "old.json")
    shape = StepShape(((1, 99), (30, 0)))
    assert loaded.step_seconds(shape) == pytest.approx(CONST + 31 * PER_TOKEN + 2 * 0.002)
    (tmp_path / "other.json").write_text(json.dumps({**data, "features": ["rows", "const"]}))
    with pytest.raises(ValueError, match="rerun calibrate"):
        StepCostModel.load(tmp_path / "other.json")


def test_kv_wall_matches_the_engine_block_accounting(synth_llama):
    budget = 3 << 20
    engine = LLMEngine(EngineConfig(model=synth_llama, dtype="float32", kv_cache_bytes=budget,
                                    kv_ram_bytes=0))  # fmt: skip
    cfg = load_model_config(synth_llama)
    wall = kv_wall(cfg, budget, "float32", Cohort())
    blocks = engine.kv.pool.num_blocks
    assert wall["kv_tokens"] // 16 == blocks
    assert Deployment.of(cfg, "float32", budget / (1 << 30)).spec.num_kv_blocks == blocks


def test_planner_capacity_grows_with_prefix_caching():
    cohort = Cohort(courses=2, course_prompt_tokens=256, turns=2, message_tokens=(8, 16),
                    reply_tokens=(4, 8), think_time_s=(2.0, 4.0))  # fmt: skip
    d = Deployment(1, "round-robin", ReplicaSpec(num_kv_blocks=256, max_num_seqs=16))
    cost = _cost(tokens=2e-4)
    planner = Planner(cost, d, cohort, 1000, SLO(ttft_ms=150, tpot_ms=50))
    no_cache, cache = (planner.capacity(p)[0] for p in POLICIES[:2])
    assert cache > no_cache > 0
    plans = planner.plan([10, 1000], 0.5, price_per_hour=2.0, policies=POLICIES[:1])
    for p, students in zip(plans, [10, 1000], strict=True):
        assert p.demand_turns_per_s == pytest.approx(students * 0.5 / 3.0)  # a message per 3 s
        assert p.replicas == math.ceil(p.demand_turns_per_s / p.turns_per_s_per_replica)
    assert plans[0].cost_per_1000_turns == pytest.approx(
        2.0 * plans[0].replicas / (plans[0].demand_turns_per_s * 3.6)
    )


def test_validate_refuses_a_run_with_kv_tiers(tmp_path, synth_llama):
    cfg = load_model_config(synth_llama)
    with pytest.raises(ValueError, match="tiers"):
        Deployment.from_argv(["serve", "--kv-cache-gb", "1"], cfg)
    argv = ["serve", "--kv-ram-gb", "0", "--kv-disk-gb", "0", "--replicas", "2", "--routing",
            "round-robin", "--max-num-seqs", "8"]  # fmt: skip
    d = Deployment.from_argv(argv, cfg)
    assert (d.replicas, d.routing, d.spec.max_num_seqs) == (2, "round-robin", 8)


def test_cli_errors_are_messages(tmp_path, capsys):
    assert main(["plan", "--students", "100", "--hardware", str(tmp_path / "none.json")]) == 2
    assert "bench calibrate" in capsys.readouterr().err
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"features": ["const"], "coef": [1.0]}))
    assert main(["sim", "validate", "--step-cost", str(bad), str(bad)]) == 2
    assert "rerun calibrate" in capsys.readouterr().err
    _cost().save(bad)
    old_fit = {**json.loads(bad.read_text()), "serving_step_factor": 1.1}
    bad.write_text(json.dumps(old_fit))  # a serving fit from before the per-step overhead
    assert main(["sim", "validate", "--step-cost", str(bad), str(bad)]) == 2
    assert "rerun calibrate" in capsys.readouterr().err


def test_fit_serving_recovers_a_known_step_and_request_overhead(tmp_path):
    from dataclasses import asdict, replace

    from tutorserve.models.loader import load_tokenizer
    from tutorserve.sim.validate import _simulate, fit_serving

    cfg, tok = load_model_config("smollm2-135m-instruct"), load_tokenizer("smollm2-135m-instruct")
    config = {"argv": ["serve", "--kv-ram-gb", "0", "--kv-disk-gb", "0", "--kv-cache-gb", "0.05"],
              "workload": "edu-multiturn", "num_requests": 24, "request_rate": 0.2,
              "burstiness": 1.0, "arrival": "gamma", "seed": 3, "served_before": []}  # fmt: skip
    truth = replace(_cost(), serving_step_overhead_s=0.015, request_overhead_s=0.04)
    run = tmp_path / "measured.json"
    records = _simulate(run, {"config": config}, truth, cfg, tok)[1].records()
    run.write_text(json.dumps({"config": config, "records": [asdict(r) for r in records]}))
    fitted = fit_serving([run], _cost(), cfg, tok)
    assert fitted.serving_step_overhead_s == pytest.approx(0.015, abs=0.001)
    assert fitted.request_overhead_s == pytest.approx(0.04, abs=0.005)


def test_datasheet_model_is_labelled_not_measured():
    from tutorserve.bench.step_cost import HARDWARE, ModelCosts

    cfg = load_model_config("smollm2-135m-instruct")
    cost = StepCostModel.from_hardware(HARDWARE["h100-80g"], ModelCosts.of(cfg), 0.004)
    assert not cost.measured and "not measured" in cost.source
    one = cost.step_seconds(StepShape(((1, 1000),)))
    assert math.isclose(one, cost.coef[0] + cost.coef[1] + 1001 * cost.coef[3], rel_tol=1e-9)


def test_an_engine_logs_every_step_it_runs(tmp_path, synth_llama):
    from tutorserve.engine.step_log import read_step_logs
    from tutorserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=synth_llama, dtype="float32", kv_ram_bytes=0,
                                    step_log_dir=str(tmp_path / "logs")))  # fmt: skip
    for i, n in enumerate((5, 9)):
        engine.add_request(f"r{i}", list(range(10, 10 + n)), SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    headers, steps = read_step_logs([tmp_path / "logs"])
    assert len(headers) == 1 and headers[0]["model"] == synth_llama
    assert headers[0]["dequant_rows"] is None  # a float32 model: nothing dequantizes
    assert len(steps) == engine.num_steps
    assert steps[0][0].rows == ((5, 0), (9, 0))  # both prompts, nothing cached before
    assert steps[1][0].rows == ((1, 5), (1, 9))
    assert sum(s.seconds for s in steps) == pytest.approx(engine.step_seconds)
    # The first step follows no busy one; each later one does (here the loop is a while).
    assert steps[0].gap_s is None and all(0 <= s.gap_s < 0.5 for s in steps[1:])
    # Steps start in order, each after the one before has run (wall clock: 1 ms of slack).
    starts = [s.started_at for s in steps]
    assert all(b > a + s.seconds - 1e-3 for a, b, s in zip(starts, starts[1:], steps, strict=False))


def _write_log(folder, header, shapes, cost, gap=None):
    from tutorserve.engine.step_log import StepLogFile, StepRecord

    log = StepLogFile(folder, header)
    for shape in shapes:
        log.append(StepRecord(len(shape.rows), 0, False, cost.step_seconds(shape), 0.0, 0, 0,
                              shape, gap))  # fmt: skip
    log.close()
    return log.path


def test_calibrating_on_replicas_step_logs_recovers_how_much_slower_they_run_together(
    tmp_path, synth_llama
):
    from tutorserve.bench.calibrate import from_step_logs
    from tutorserve.engine.step_log import StepLogFile, StepRecord

    rng = random.Random(2)
    truth = _cost(rows=0.002, decode_kv=1e-6)
    header = {"model": synth_llama, "dtype": "float32", "threads": 1, "block_size": 16,
              "max_num_batched_tokens": 2048, "dequant_rows": None}  # fmt: skip
    logs = [StepLogFile(tmp_path / "x2", header) for _ in range(2)]
    # Two replicas stepping on one clock, the second 200 steps from 60 s on (the first 600 from
    # 0): a step that starts inside the other's current step takes 1.4× its time alone.
    clock, left, current = [100.0, 160.0], [600, 200], [(0.0, 0.0), (0.0, 0.0)]
    while any(left):
        e = min((i for i in (0, 1) if left[i]), key=lambda i: clock[i])
        left[e] -= 1
        shape = StepShape(tuple((rng.choice([1, 1, rng.randint(2, 200)]), rng.randint(0, 1500))
                                for _ in range(rng.randint(1, 24))))  # fmt: skip
        start, (o_start, o_end) = clock[e], current[1 - e]
        busy = o_start <= start < o_end
        seconds = truth.step_seconds(shape) * (1.4 if busy else 1.0)
        logs[e].append(StepRecord(len(shape.rows), 0, False, seconds, 0.0, 0, 0, shape,
                                  started_at=start))  # fmt: skip
        current[e], clock[e] = (start, start + seconds), start + seconds + rng.uniform(0, 0.03)
    for f in logs:
        f.close()
    model, _ = from_step_logs([str(tmp_path / "x2")], "test")
    assert 100 < model.meta["sibling_busy_steps"] < 700  # both kinds of step are there
    assert model.sibling_busy_factor == pytest.approx(1.4)
    assert model.coef == pytest.approx(truth.coef, abs=1e-9)
    assert model.error["median_rel_error"] == pytest.approx(0, abs=1e-9)


def test_calibrating_on_step_logs_recovers_the_server_steps_cost(tmp_path, capsys, synth_llama):
    from tutorserve.bench.calibrate import from_step_logs

    rng = random.Random(1)
    truth = _cost(rows=0.002, decode_kv=1e-6, dequant_steps=0.04)
    truth.dequant_rows = 64
    header = {"model": synth_llama, "dtype": "float32", "threads": 1, "block_size": 16,
              "max_num_batched_tokens": 2048, "dequant_rows": 64}  # fmt: skip
    shapes = [StepShape(tuple((rng.choice([1, 1, rng.randint(2, 200)]), rng.randint(0, 1500))
                              for _ in range(rng.randint(1, 24))))
              for _ in range(400)]  # fmt: skip
    # Two replicas' logs, the second cut short as a killed engine leaves it.
    _write_log(tmp_path / "a", header, shapes[:200], truth, gap=0.002)
    cut = _write_log(tmp_path / "b", header, shapes[200:], truth, gap=0.004)
    cut.write_text(cut.read_text() + '{"shape": {"rows": [[1, ')
    kept = cut.with_name(cut.name + ".gz")  # logs kept in the repository are gzipped
    kept.write_bytes(gzip.compress(cut.read_bytes()))
    cut.unlink()
    model, samples = from_step_logs([str(tmp_path / "a"), str(tmp_path / "b")], "test")
    assert model.coef == pytest.approx(truth.coef, abs=1e-9)
    assert model.dequant_rows == 64 and model.meta["engines"] == 2
    assert len(samples) == 400 and model.error["steps"] == 100  # every fourth run of 50 steps
    assert model.error["median_rel_error"] == pytest.approx(0, abs=1e-9)
    # The loop's time between busy steps, measured, is what serving adds to each step.
    assert model.serving_step_overhead_s == pytest.approx(0.003)
    # Engines of other settings are not one calibration; no logs is a message, not a crash.
    _write_log(tmp_path / "c", header | {"threads": 2}, shapes[:10], truth)
    with pytest.raises(ValueError, match="different settings"):
        from_step_logs([str(tmp_path / "a"), str(tmp_path / "c")], "test")
    _write_log(tmp_path / "e", {"model": synth_llama}, shapes, truth)
    with pytest.raises(ValueError, match="lacks the engine's settings"):
        from_step_logs([str(tmp_path / "e")], "test")
    # The command saves the fit with the RAM tier's restore cost probed on the logs' model.
    logs = [str(tmp_path / "a"), str(tmp_path / "b")]
    out = tmp_path / "cal"
    argv = ["bench", "calibrate", "--from-step-logs", *logs, "--model", synth_llama]
    assert main([*argv, "--out", str(out)]) == 0
    saved = StepCostModel.load(out / "step-cost.json")
    assert saved.coef == pytest.approx(truth.coef, abs=1e-9)
    assert saved.restore_s_per_block is not None and saved.restore_s_per_block >= 0
    _write_log(tmp_path / "d", header | {"model": "/elsewhere/other.gguf"}, shapes, truth)
    assert main([*argv[:3], str(tmp_path / "d"), *argv[-2:], "--out", str(out)]) == 2
    assert "step logs are of /elsewhere/other.gguf" in capsys.readouterr().err
    assert main(["bench", "calibrate", "--from-step-logs", str(tmp_path / "none")]) == 2
    assert "no such step log" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["bench", "calibrate", "--from-step-logs", str(tmp_path / "empty")]) == 2
    assert "no step logs" in capsys.readouterr().err
