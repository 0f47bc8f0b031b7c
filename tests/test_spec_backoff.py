"""When to draft (spec/backoff.py): the measured policy against a step-cost model where drafting
pays at small batches and not at large ones, and in the engine."""

from __future__ import annotations

from tutorserve import LLM, SamplingParams
from tutorserve.spec.backoff import FixedBackoff, MeasuredBackoff, backoff_named

K = 4  # drafts per row


def _step(running: int, drafts: int, kept: float) -> tuple[float, float]:
    """(seconds, output tokens) of a decode step: 10 ms of weights, then 1 ms a query row;
    `kept` of the `drafts` drafted tokens are kept."""
    return 0.010 + 0.001 * (running + drafts), running + kept * drafts


def _run(backoff: MeasuredBackoff, running: int, steps: int, accept: float | list[float]) -> float:
    """The share of `steps` decode steps that drafted (K a row); `accept` the share of drafts
    kept, or a list of shares that the steps with drafts go through in turn."""
    cycle = accept if isinstance(accept, list) else [accept]
    drafted = 0
    for _ in range(steps):
        d = backoff.should_draft(running)
        drafts = running * K if d else 0
        backoff.observe(running, drafts, *_step(running, drafts, cycle[drafted % len(cycle)]))
        drafted += d
    return drafted / steps


def test_measured_backoff_drafts_where_drafts_pay_and_tries_the_other_choice_now_and_then():
    backoff = MeasuredBackoff(limit=64, explore_every=32)
    # batch 1: a step costs 11 ms a row, a draft 1 ms: drafts pay if over 1/11 are kept;
    # batch 32: 1.31 ms a row, so they pay only above 76 %
    assert _run(backoff, 1, 320, accept=0.5) > 0.95
    assert _run(backoff, 32, 320, accept=0.5) < 0.05
    b1, b32 = backoff.buckets[1], backoff.buckets[6]
    assert abs(b1.per_row.value - 0.011) < 1e-9 and abs(b1.per_draft.value - 0.001) < 1e-9
    assert abs(b32.kept.value - 0.5) < 1e-9
    # both choices are still measured after the start: 32 steps on, then 64, 128
    assert b1.per_row.samples >= MeasuredBackoff.WARMUP + 3
    assert b32.per_draft.samples >= MeasuredBackoff.WARMUP + 3
    # acceptance falls to nothing: at batch 1 a draft now costs 1 ms for nothing, and it stops
    # once α, over its last ~50 steps with drafts, falls under 1/11 (from 1/2: ~85 steps)
    assert _run(backoff, 1, 320, accept=0.0) < 0.3
    assert _run(backoff, 1, 320, accept=0.0) < 0.05
    # above the ceiling nobody drafts, and steps there are not counted
    assert _run(backoff, 65, 50, accept=1.0) == 0
    assert 7 not in backoff.buckets


def test_a_step_whose_drafts_were_all_refused_costs_no_more_than_its_rows():
    """What a step costs is the hardware's; what is kept, the workload's. At batch 8 (per row
    2.25 ms, a draft 1 ms: drafts pay above 44 % kept), acceptance swings between whole
    drafts kept and none, in runs of five steps: timed whole against plain steps, a run of
    refusals (a step at 50 ms for 8 tokens, 6.25 ms a token against 2.25) loses the lead for a
    period; counted per drafted token, α stays near 1/2 and drafting keeps it."""
    backoff = MeasuredBackoff(limit=64)
    runs = [1.0] * 5 + [0.0] * 5
    assert _run(backoff, 8, 400, accept=runs) > 0.9


def test_measured_backoff_tries_a_losing_choice_ever_less_often_yet_notices_a_change():
    """Batch 32 with every draft refused: a try drafts 128 tokens for nothing (128 ms); the
    tries thin out to one in 256. Once drafts are kept whole, the next try pays (kept · p
    over the drafts' cost), the tries follow at once, and drafting takes the lead within a few
    of them."""
    backoff = MeasuredBackoff(limit=64, explore_every=32)
    assert _run(backoff, 32, 2000, accept=0.0) < 0.01
    assert backoff.buckets[6].period == MeasuredBackoff.MAX_EXPLORE_EVERY
    _run(backoff, 32, MeasuredBackoff.MAX_EXPLORE_EVERY + 30, accept=1.0)
    assert _run(backoff, 32, 200, accept=1.0) > 0.9


def test_acceptance_is_counted_per_drafted_token():
    """Batch 1, a draft of one token refused, then one of four kept, in turn: 4 of 5 drafted
    tokens kept. With a draft costing 0.65 of a plain step's 11 ms, drafting pays above 65 %;
    the mean of the steps' shares (0 and 1) would say 50 % and stop it."""
    backoff = MeasuredBackoff(limit=64)
    drafted = 0
    for _ in range(400):
        if backoff.should_draft(1):
            drafts, kept = (1, 0) if drafted % 2 else (4, 4)
            backoff.observe(1, drafts, 0.011 + 0.00715 * drafts, 1 + kept)
            drafted += 1
        else:
            backoff.observe(1, 0, 0.011, 1)
    assert drafted / 400 > 0.9


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
    b = llm.engine.backoff.buckets[MeasuredBackoff.bucket(16)]
    assert min(b.per_row.samples, b.per_draft.samples) >= MeasuredBackoff.WARMUP
    assert b.per_row.value > 0 and 0 <= b.kept.value <= 1


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
