"""When to draft (spec/backoff.py): the measured policy against a step-cost model where drafting
pays at small batches and not at large ones, and in the engine."""

from __future__ import annotations

from tutorserve import LLM, SamplingParams
from tutorserve.spec.backoff import FixedBackoff, MeasuredBackoff, backoff_named

K = 4  # drafts per row


def _step(running: int, drafted: bool, accept: float) -> tuple[float, float]:
    """(seconds, output tokens) of a decode step: 10 ms of weights, then 1 ms a query row;
    with drafts every row verifies K and keeps `accept` of them."""
    rows = running * (1 + K) if drafted else running
    tokens = running * (1 + accept * K) if drafted else running
    return 0.010 + 0.001 * rows, tokens


def _run(backoff: MeasuredBackoff, running: int, steps: int, accept: float | list[float]) -> float:
    """The share of `steps` decode steps that drafted; `accept` the share of drafts kept, or a
    list of shares that the steps with drafts go through in turn."""
    cycle = accept if isinstance(accept, list) else [accept]
    drafted = 0
    for _ in range(steps):
        d = backoff.should_draft(running)
        backoff.observe(running, d, *_step(running, d, cycle[drafted % len(cycle)]))
        drafted += d
    return drafted / steps


def test_measured_backoff_drafts_where_drafts_pay_and_tries_the_other_choice_now_and_then():
    backoff = MeasuredBackoff(limit=64, explore_every=32)
    # batch 1: 14 ms for 3 tokens against 11 ms for 1; batch 32: 170 ms for 96 against 42 for 32
    assert _run(backoff, 1, 320, accept=0.5) > 0.95
    assert _run(backoff, 32, 320, accept=0.5) < 0.05
    # both choices are still measured after the start: 32 steps on, then 64, 128
    assert backoff.buckets[1].arms[0].samples >= MeasuredBackoff.WARMUP + 3
    assert backoff.buckets[6].arms[1].samples >= MeasuredBackoff.WARMUP + 3
    # acceptance falls to nothing: at batch 1 drafting now costs 40 % a token, and it stops
    assert _run(backoff, 1, 320, accept=0.0) < 0.1
    # above the ceiling nobody drafts, and steps there are not counted
    assert _run(backoff, 65, 50, accept=1.0) == 0
    assert 7 not in backoff.buckets


def test_measured_backoff_tries_a_losing_choice_ever_less_often_yet_notices_a_change():
    """Batch 32 with every draft refused: 170 ms for 32 tokens against 42 ms. A try in 32 steps
    would draft 3 % of them, each costing 4× a step; the tries thin out to one in 256. Once
    drafts are kept whole (170 ms for 160 tokens), the next try beats the leader, the tries
    follow at once, and drafting takes the lead within a few of them."""
    backoff = MeasuredBackoff(limit=64, explore_every=32)
    assert _run(backoff, 32, 2000, accept=0.0) < 0.01
    assert backoff.buckets[6].period == MeasuredBackoff.MAX_EXPLORE_EVERY
    _run(backoff, 32, MeasuredBackoff.MAX_EXPLORE_EVERY + 30, accept=1.0)
    assert _run(backoff, 32, 200, accept=1.0) > 0.9


def test_measured_backoff_weighs_steps_by_their_tokens():
    """Batch 4, drafts all kept or all refused in turn: with drafts 60 ms for 24 tokens (2.5 ms
    a token) against 3.5 without. A mean of per-step ratios, (7.5 + 1.5) / 2 = 4.5 ms, would
    call drafting the loser."""
    backoff = MeasuredBackoff(limit=64)
    assert _run(backoff, 4, 320, accept=[0.0, 1.0]) > 0.9


def test_fixed_backoff_drafts_up_to_its_ceiling_and_names_choose_a_policy():
    fixed = backoff_named("fixed", 8)
    assert isinstance(fixed, FixedBackoff)
    assert [fixed.should_draft(n) for n in (1, 8, 9)] == [True, True, False]
    assert isinstance(backoff_named("measured", 8), MeasuredBackoff)
    try:
        backoff_named("sometimes", 8)
    except ValueError as e:
        assert "fixed, measured" in str(e)
    else:
        raise AssertionError("an unknown policy name must be refused")


def test_the_engine_measures_both_choices_and_decodes_as_without_speculation(
    synth_llama, mixed_prompts
):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(synth_llama, dtype="float32").generate(mixed_prompts, params)
    llm = LLM(synth_llama, dtype="float32", speculative="ngram",
              speculative_disable_by_batch_size=64)  # fmt: skip
    assert isinstance(llm.engine.backoff, MeasuredBackoff)  # the default
    outs = llm.generate(mixed_prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # 16 requests decode together: their steps were timed with drafts and without
    arms = llm.engine.backoff.buckets[MeasuredBackoff.bucket(16)].arms
    assert min(a.samples for a in arms) >= MeasuredBackoff.WARMUP
    assert all(a.per_token > 0 for a in arms)


def test_the_engine_asks_for_the_batch_the_step_will_hold(synth_llama, mixed_prompts):
    """A request arriving between steps joins the next one: the back-off is asked for that
    batch, so a step over the ceiling verifies no drafts (asked for the batch the last step
    left, it drafted for the one request running and verified beside the newcomer)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(synth_llama, dtype="float32", speculative="ngram", speculative_backoff="fixed",
              speculative_disable_by_batch_size=1)  # fmt: skip
    engine, asked = llm.engine, []
    should_draft = engine.backoff.should_draft
    engine.backoff.should_draft = lambda n: asked.append(n) or should_draft(n)
    engine.proposer.propose_batch = lambda rows: [[5, 6] for _ in rows]  # always a draft
    engine.add_request("a", mixed_prompts[1], params)
    for _ in range(3):
        engine.step()
    drafts = engine.spec.num_draft_tokens
    assert asked[-1] == 1 and drafts > 0  # alone, it drafts
    engine.add_request("b", mixed_prompts[0], params)
    engine.step()
    assert asked[-1] == 2
    assert engine.spec.num_draft_tokens == drafts  # nothing verified in the step with "b"
