"""A call whose replica dies goes to another replica (`cluster/failover.py`), without Ray's
cluster: fake replica calls replay one reference generation from wherever their prompt says it
got to, and die on cue. The stitched stream must be what one uninterrupted call gives."""

import asyncio
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError

from tutorserve.cluster import failover
from tutorserve.cluster.failover import ResumingCall, continuable
from tutorserve.engine.detokenizer import IncrementalDetokenizer
from tutorserve.engine.outputs import RequestMetrics, RequestOutput
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.sampling_params import SamplingParams, StructuredOutputs

# Multi-byte characters, so a seam can fall inside one (its bytes are separate tokens).
ANSWER = "½ + ⅓ = ⅚, café. Next: what is ⅔ of 9? 🍕 Explain each step."


@pytest.fixture(scope="module")
def tokenizer(synth_llama):
    return Tokenizer.from_hf_dir(Path(synth_llama))


class FakeCall:
    """A replica's stream of one request: the reference tokens after those its prompt already
    holds, one per output, dying before output `die_at` (never if None)."""

    def __init__(self, tokenizer, prompt, reference, params, rid, die_at):
        made = len(prompt) - PROMPT_LEN
        self.tokens = reference[made : made + params.max_tokens]
        self.tokenizer, self.prompt, self.rid, self.die_at = tokenizer, prompt, rid, die_at
        self.detok = IncrementalDetokenizer(tokenizer)
        self.sent = 0
        self.cancelled = False

    async def __anext__(self):
        if self.sent == self.die_at:
            raise ActorDiedError()
        if self.sent == len(self.tokens):
            raise StopAsyncIteration
        before = self.detok.text
        self.detok.add(self.tokens[self.sent])
        self.sent += 1
        done = self.sent == len(self.tokens)
        return RequestOutput(
            request_id=self.rid, prompt=None, prompt_token_ids=self.prompt,
            text=self.detok.text, token_ids=list(self.tokens[: self.sent]), finished=done,
            finish_reason="length" if done else None,
            metrics=RequestMetrics(1.0, 2.0, 3.0 if done else None, len(self.prompt),
                                   len(self.prompt) // 2, self.sent, 0),
            delta_text=self.detok.text[len(before) :],
        )  # fmt: skip

    def cancel(self):
        self.cancelled = True


PROMPT_LEN = 7


def run(tokenizer, params, deaths, n=1):
    """The client's outputs of one request whose calls die as `deaths` says (one entry per
    call: the output it dies before, or None), and the calls made."""
    reference = tokenizer.encode(ANSWER, add_special_tokens=False)
    prompt = list(range(PROMPT_LEN))
    calls = []

    def make_call(attempt, ids, p):
        rid = f"req~{attempt}" if attempt else "req"  # as ClusterFront names them
        calls.append(FakeCall(tokenizer, ids, reference, p, rid, deaths[attempt]))
        return calls[-1]

    async def drain():
        call = ResumingCall("req", prompt, params, n, make_call, tokenizer)
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(await call.__anext__())
        return outs

    return asyncio.run(drain()), calls, reference


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(failover, "_FIRST_BACKOFF_S", 0.0)


def whole(tokenizer, reference, max_tokens):
    return tokenizer.decode(reference[:max_tokens])


@pytest.mark.parametrize("deaths", [
    [None],  # no failure: the outputs pass through
    [0, None],  # died before its first output: sent again as it was
    [1, None],
    [3, None],  # inside a multi-byte character (½ is two byte tokens)
    [5, 4, None],  # died twice
    [20, None],
])  # fmt: skip
def test_a_stream_continues_where_its_replica_died(tokenizer, deaths):
    params = SamplingParams(max_tokens=24, temperature=0)
    outs, calls, reference = run(tokenizer, params, deaths)
    assert len(calls) == len(deaths)
    expected = whole(tokenizer, reference, 24)
    assert "".join(o.delta_text for o in outs) == expected
    last = outs[-1]
    assert last.text == expected and last.token_ids == reference[:24]
    assert last.finish_reason == "length" and {o.request_id for o in outs} == {"req"}
    assert last.prompt_token_ids == list(range(PROMPT_LEN))
    m = last.metrics
    assert (m.num_prompt_tokens, m.num_output_tokens) == (PROMPT_LEN, 24)
    assert m.num_cached_tokens == PROMPT_LEN // 2  # the first call's, not the continuation's
    assert [o.token_ids for o in outs] == [reference[: i + 1] for i in range(24)]
    # Each continuation asked only for what was owed, its prompt holding what was made.
    made = 0
    for call, died in zip(calls, deaths, strict=True):
        assert call.prompt == list(range(PROMPT_LEN)) + reference[:made]
        assert len(call.tokens) == 24 - made
        made += died or 0


def test_what_depends_on_where_the_output_began_is_not_continued(tokenizer):
    for params, n in [(SamplingParams(max_tokens=24, stop=["zzz"]), 1),
                      (SamplingParams(max_tokens=24, presence_penalty=0.5), 1),
                      (SamplingParams(max_tokens=24,
                                      structured=StructuredOutputs(regex="[a-z]+")), 1),
                      (SamplingParams(max_tokens=24), 2)]:  # fmt: skip
        assert not continuable(params, n)
        with pytest.raises(ActorDiedError):
            run(tokenizer, params, [3, None], n)
        outs, calls, _ = run(tokenizer, params, [0, None], n)  # nothing sent yet: sent again
        assert len(calls) == 2 and outs[-1].finished
    assert continuable(SamplingParams(max_tokens=24, repetition_penalty=1.2, seed=3), 1)


def test_a_cancelled_call_is_not_sent_again(tokenizer):
    reference = tokenizer.encode(ANSWER, add_special_tokens=False)
    calls = []

    def make_call(attempt, ids, p):
        calls.append(FakeCall(tokenizer, ids, reference, p, "req", 1))
        return calls[-1]

    async def go():
        call = ResumingCall("req", list(range(PROMPT_LEN)), SamplingParams(max_tokens=9),
                            1, make_call, tokenizer)  # fmt: skip
        await call.__anext__()
        call.cancel()
        await call.__anext__()

    with pytest.raises(ActorDiedError):
        asyncio.run(go())
    assert len(calls) == 1 and calls[0].cancelled


def test_it_gives_up_once_no_replica_answers_in_time(tokenizer, monkeypatch):
    monkeypatch.setattr(failover, "RESUME_DEADLINE_S", 0.0)
    with pytest.raises(ActorDiedError):
        run(tokenizer, SamplingParams(max_tokens=24), [0, 0, 0, None])
