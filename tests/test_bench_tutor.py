"""`tutorserve bench tutor`: its greedy mode and the counters it reports."""

import asyncio

from tutorserve.bench.tutor_turns import _answers, _Greedy, run_tutor_bench


class _Recorder:
    name = "fake"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def stream(self, messages, **kwargs):
        self.calls.append(kwargs)
        yield "ok"


def test_greedy_asks_every_call_for_temperature_zero():
    inner = _Recorder()
    llm = _Greedy(inner)

    async def call():
        return [t async for t in llm.stream([], max_tokens=7, temperature=0.3, session_id="s")]

    assert asyncio.run(call()) == ["ok"] and llm.name == "fake"
    assert inner.calls == [{"max_tokens": 7, "temperature": 0.0, "session_id": "s"}]


def test_greedy_runs_with_and_without_drafts_compute_the_same_turns(synth_llama_long):
    runs = [
        run_tutor_bench(synth_llama_long, 1, 1, {"dtype": "float32", "speculative": spec}, True)
        for spec in (None, "suffix")
    ]
    (plain, plain_counts), (drafted, drafted_counts) = runs
    assert [s.reply for s in plain] == [s.reply for s in drafted]
    for key in ("prompt_tokens", "prefix_hit_tokens", "model_calls"):
        assert plain_counts[key] == drafted_counts[key]
    assert plain_counts["model_calls"] >= len(plain) and plain_counts["mean_tpot_ms"] > 0
    assert plain_counts["kv_evictions"] == 0  # the default pool holds this whole run
    assert drafted_counts["spec_accepted_tokens"] > 0 == plain_counts["spec_draft_tokens"]
    # Steps by kind: only the run with drafts verifies any; both compute prompts and decode.
    assert plain_counts["verify_steps"] == 0 < drafted_counts["verify_steps"]
    for counts in (plain_counts, drafted_counts):
        assert counts["prefill_steps"] > 0 and counts["decode_steps"] > 0
        assert counts["prefill_seconds"] > 0
        total = sum(counts[f"{k}_seconds"] for k in ("prefill", "verify", "decode"))
        assert 0 < counts["outside_forward_seconds"] < total


def test_each_variant_of_a_class_answers_wrongly_twice_then_rightly():
    from tutorserve.tutor.answers import is_correct
    from tutorserve.tutor.courses import load_courses

    for course in load_courses().values():
        for problem in course.problem.values():
            variants = [_answers(problem, v) for v in range(16)]
            for answers in variants:
                assert [is_correct(a, problem) for a in answers] == [False, False, True]
            # Variant 0 is the class that answers alike; others differ from it.
            assert variants[0] == _answers(problem) and variants[1] != variants[0]
            if len(problem.misconceptions) > 1:
                assert variants[1][0] != variants[0][0]  # another authored mistake first


def test_sessions_in_flight_are_capped(synth_llama_long):
    counts = {
        limit: run_tutor_bench(
            synth_llama_long, 2, 1, {"dtype": "float32"}, True, limit, varied=True
        )[1]["max_sessions_in_flight"]
        for limit in (None, 1)
    }
    assert counts == {None: 4, 1: 1}  # two courses of two students
