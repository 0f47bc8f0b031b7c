"""The serving benchmark: metrics maths on hand-built traces, arrivals, workloads, one real run."""

import json
import math
import statistics
import subprocess
import sys

import numpy as np
import pytest

from tutorserve.bench.arrivals import arrival_times
from tutorserve.bench.client import SERVER_COUNTERS
from tutorserve.bench.report import speculation_lines
from tutorserve.bench.serving import server_counts
from tutorserve.bench.serving_metrics import SLO, RequestRecord, percentile, summarize
from tutorserve.bench.workloads import serving_workload
from tutorserve.models.loader import load_tokenizer


def rec(start, chunks, end, tokens, **kw):
    return RequestRecord(0, 0, 100, start, chunks, end, tokens, **kw)


def test_request_metrics_from_a_trace():
    r = rec(1.0, [1.5, 1.7, 2.0, 2.1], 2.2, 5)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.2)
    # 4 gaps after the first token over chunks that carried 5 tokens: (2.1 - 1.5) / 4.
    assert r.tpot == pytest.approx(0.15)
    assert r.itls == pytest.approx([0.2, 0.3, 0.1])
    assert rec(0, [0.3], 0.3, 1).tpot is None


def test_summary_and_goodput():
    records = [
        rec(0.0, [0.1, 0.2, 0.3], 0.3, 3),  # TTFT 100 ms, TPOT 100 ms: meets both SLOs
        rec(0.0, [0.5, 0.6, 0.7], 0.7, 3),  # TTFT 500 ms: misses the TTFT SLO
        rec(1.0, [1.1, 1.5, 1.9], 1.9, 3),  # TPOT 400 ms: misses the TPOT SLO
        rec(1.0, [], None, 0, error="HTTP 429"),
    ]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=200))
    assert (s["completed"], s["errors"]) == (3, 1)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["goodput"] == pytest.approx(0.5)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["mean_ttft_ms"] == pytest.approx((100 + 500 + 100) / 3)
    assert s["p50_tpot_ms"] == pytest.approx(100)
    assert s["p99_e2e_ms"] == pytest.approx(np.percentile([300, 700, 900], 99))
    no_slo = summarize(records, duration_s=2.0, slo=SLO())
    assert no_slo["goodput"] == pytest.approx(1.5)


def test_history_cached_counts_what_a_turn_carries_over_from_the_previous_one():
    def turn(session, t, prompt, out, cached):
        return RequestRecord(session, t, prompt, 0.0, [0.1], 0.2, out, cached_tokens=cached)

    records = [
        turn(0, 0, 500, 50, 0),  # a first turn carries nothing over
        turn(0, 1, 600, 40, 544),  # carries 550: 544 cached (whole blocks)
        turn(0, 2, 700, 60, 300),  # carries 640: 300 cached (its replica lost the rest)
        turn(1, 1, 400, 30, 100),  # its first turn failed: nothing to compare with
    ]
    s = summarize(records, duration_s=1.0, slo=SLO())
    assert s["history_cached_token_rate"] == pytest.approx((544 + 300) / (550 + 640))
    assert "history_cached_token_rate" not in summarize(records[:1], duration_s=1.0, slo=SLO())


def test_a_runs_server_counters_are_the_differences_of_two_scrapes():
    keys = SERVER_COUNTERS  # queries, hits, drafted, accepted, steps, their seconds, preempted
    before = dict(zip(keys, (100, 50, 10, 4, 20, 1.0, 3), strict=True))
    after = dict(zip(keys, (500, 350, 410, 104, 120, 3.5, 7), strict=True))
    counts = server_counts(before, after)
    assert counts == {"server_prefix_cache_hit_rate": 0.75, "spec_draft_tokens": 400,
                      "spec_accepted_tokens": 100, "spec_acceptance_rate": 0.25,
                      "server_preemptions": 4, "server_engine_steps": 100,
                      "server_mean_step_ms": 25.0}  # fmt: skip
    assert server_counts({}, after) == {}  # no /metrics before the run: nothing to say
    plain = {k: v for k, v in after.items() if k.startswith("prefix")}
    assert server_counts(plain, plain) == {}  # no queries in between, no drafts
    run = {"config": {"system": "ours-ngram", "request_rate": 1.0}, "summary": counts}
    assert speculation_lines([run, {"config": {"system": "x", "request_rate": 1.0},
                                    "summary": {}}]) == [
        "- ours-ngram at 1.0 req/s: 100 of 400 drafted tokens accepted (25%)"
    ]  # fmt: skip


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert math.isnan(percentile([], 50))


def test_arrivals_are_deterministic_with_the_asked_rate_and_burstiness():
    a = arrival_times(4000, 5.0, burstiness=1.0, seed=3)
    assert a == arrival_times(4000, 5.0, burstiness=1.0, seed=3)
    assert a != arrival_times(4000, 5.0, burstiness=1.0, seed=4)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)
    # Gamma(k) gaps have a squared coefficient of variation of 1/k: burstier below 1.
    for k in (0.25, 1.0, 4.0):
        g = np.diff(arrival_times(4000, 5.0, burstiness=k, seed=1))
        assert (g.std() / g.mean()) ** 2 == pytest.approx(1 / k, rel=0.15)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]


def test_ramp_peaks_in_the_middle():
    a = np.array(arrival_times(4000, 10.0, profile="ramp", seed=0))
    assert (np.diff(a) >= 0).all()
    span = a[-1]
    assert span == pytest.approx(4000 / (0.625 * 10.0), rel=0.05)
    quarters = np.histogram(a, bins=4, range=(0, span))[0]
    assert quarters[1] > 1.5 * quarters[0] and quarters[2] > 1.5 * quarters[3]
    peak = np.histogram(a, bins=20, range=(0, span))[0].max() / (span / 20)
    assert peak == pytest.approx(10.0, rel=0.2)


@pytest.fixture(scope="module")
def smol_tok():
    return load_tokenizer("smollm2-135m-instruct")


def test_edu_shared_prefix_shape(smol_tok):
    sessions = serving_workload(smol_tok, "edu-shared-prefix", 64, seed=5)
    assert len(sessions) == 64 and all(len(s.turns) == 1 for s in sessions)
    assert serving_workload(smol_tok, "edu-shared-prefix", 64, seed=5) == sessions
    courses = {s.course for s in sessions}
    assert len(courses) == 4
    for c in courses:
        systems = {s.system for s in sessions if s.course == c}
        assert len(systems) == 1  # every student of a course has the very same course prompt
        n = len(smol_tok.encode(systems.pop(), add_special_tokens=False))
        assert 1000 <= n <= 2100
    assert len({s.turns[0].question for s in sessions}) == 64
    assert all(32 <= s.turns[0].max_tokens <= 96 for s in sessions)
    # Rendered prompts of one course share their whole course prompt as a token prefix.
    a, b = [s for s in sessions if s.course == 0][:2]
    ta, tb = (smol_tok.encode(smol_tok.apply_chat_template(x.messages([], 0))) for x in (a, b))
    common = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    assert common >= 1000


def test_edu_multiturn_history_grows(smol_tok):
    sessions = serving_workload(smol_tok, "edu-multiturn", 16, seed=2)
    assert [len(s.turns) for s in sessions] == [4] * 4
    s = sessions[0]
    assert s.turns[0].think_time_s == 0 and all(1 <= t.think_time_s <= 4 for t in s.turns[1:])
    answers = ["First answer.", "Second answer.", "Third answer."]
    lengths = []
    for k in range(4):
        msgs = s.messages(answers[:k], k)
        assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * k + ["user"]
        assert msgs[-1]["content"] == s.turns[k].question
        lengths.append(len(smol_tok.encode(smol_tok.apply_chat_template(msgs))))
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0] + 60


def test_random_workload_and_bad_names(smol_tok):
    sessions = serving_workload(smol_tok, "random", 20, seed=0)
    lengths = [len(smol_tok.encode(s.turns[0].question)) for s in sessions]
    assert min(lengths) >= 64 and max(lengths) <= 1100 and statistics.pstdev(lengths) > 100
    with pytest.raises(ValueError, match="unknown workload"):
        serving_workload(smol_tok, "nope", 4)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tutorserve.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("workload,n", [("random", 6), ("edu-multiturn", 4)])
def test_bench_serve_end_to_end(live_server, synth_llama, tmp_path, workload, n):
    out = tmp_path / "result.json"
    r = run_cli(
        "bench", "serve", "--base-url", live_server.url, "--model", live_server.model,
        "--tokenizer", synth_llama, "--workload", workload, "--num-requests", str(n),
        "--request-rate", "20", "--slo-ttft-ms", "60000", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    s = result["summary"]
    assert (s["completed"], s["errors"]) == (n, 0)
    sessions = serving_workload(load_tokenizer(synth_llama), workload, n, seed=0)
    # EOS is ignored, so every request produced exactly the workload's output length.
    want = sorted(t.max_tokens for x in sessions for t in x.turns)
    assert sorted(x["output_tokens"] for x in result["records"]) == want
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    assert 0 <= s["server_prefix_cache_hit_rate"] <= 1
    if workload == "edu-multiturn":  # later turns carry the earlier ones: the cache must hit
        assert s["server_prefix_cache_hit_rate"] > 0.3
    assert "| " + live_server.url in r.stdout

    png = tmp_path / "plots.png"
    r = run_cli("bench", "report", str(out), "--out", str(png))
    assert r.returncode == 0, r.stderr
    assert png.stat().st_size > 10_000 and "goodput" in r.stdout


def test_bench_cli_errors(tmp_path):
    r = run_cli("bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                "--request-rate", "0")  # fmt: skip
    assert r.returncode == 2 and "error:" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = run_cli("bench", "report", str(bad))
    assert r.returncode == 2 and "not a bench result" in r.stderr
    r = run_cli("bench", "compare", "--systems", "tutorserve,nope")
    assert r.returncode == 2 and "unknown system" in r.stderr
    r = run_cli("bench", "compare", "--systems", "tutorserve", "--kill-replica-after", "-1")
    assert r.returncode == 2 and "--kill-replica-after" in r.stderr


def test_a_run_with_a_killed_replica_is_labelled_so():
    from tutorserve.bench.report import serving_table

    def result(fault):
        config = {"system": "x2", "workload": "w", "request_rate": 1.0, "fault": fault}
        return {"config": config, "summary": {}}

    table = serving_table([result(None), result({"killed_pid": 7, "killed_at_s": 30.2}),
                           result({"killed_pid": None, "killed_at_s": None})])  # fmt: skip
    rows = [line.split(" | ")[0] for line in table.splitlines()[2:]]
    assert rows == ["| x2", "| x2, a replica killed at 30 s", "| x2"]


def test_ttft_cut_ceiling_of_a_cold_burst():
    """Two courses of two students: 32 shared tokens (two blocks of 16) and 4 of their own.
    Cached, the best order completes after 36, 40, 76, 80 tokens (mean 58); uncached after
    36, 72, 108, 144 (mean 90)."""
    from tutorserve.bench.offline import ttft_cut_ceiling
    from tutorserve.bench.workloads import Request

    prompts = [[c] * 32 + [s] * 4 for c in (1, 5) for s in (2, 3)]
    burst = [Request(prompt_token_ids=p, max_tokens=1, course=p[0]) for p in prompts]
    assert ttft_cut_ceiling(burst, 16) == pytest.approx(1 - 58 / 90)
