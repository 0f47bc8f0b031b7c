"""The OpenAI API's agent features through the official `openai` client: structured outputs,
tool calls, logprobs, n, penalties and logit bias, echo; streamed and not."""

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tutorserve import LLM, SamplingParams

USER = [{"role": "user", "content": "Which step of 3x + 2 = 11 comes first?"}]
STEP = {
    "type": "object",
    "properties": {
        "step": {"enum": ["subtract 2", "divide by 3"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
        "why": {"type": "string", "maxLength": 12},
    },
    "required": ["step", "confidence", "why"],
    "additionalProperties": False,
}
GRADE = {
    "type": "function",
    "function": {
        "name": "record_grade",
        "description": "Store a student's grade",
        "parameters": {
            "type": "object",
            "properties": {
                "student": {"type": "string", "maxLength": 8},
                "grade": {"enum": ["A", "B", "C"]},
            },
            "required": ["student", "grade"],
        },
    },
}
HINT = {"type": "function", "function": {"name": "give_hint", "parameters": {
    "type": "object", "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["level"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline(synth_llama):
    return LLM(synth_llama, dtype="float32", num_kv_blocks=2048)


def _chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=USER, **kw)


def test_json_schema_response_format_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "step", "schema": STEP}}
    for seed in range(3):
        reply = _chat(client, response_format=fmt, max_tokens=200, seed=seed)
        jsonschema.validate(json.loads(reply.choices[0].message.content), STEP)
        assert reply.choices[0].finish_reason == "stop"
    stream = _chat(client, response_format=fmt, max_tokens=200, seed=7, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    jsonschema.validate(json.loads(text), STEP)
    obj = _chat(client, response_format={"type": "json_object"}, max_tokens=200, seed=1)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_pydantic_parse_helper(client):
    """The client's own structured-output helper (what agent frameworks call)."""

    class Verdict(BaseModel):
        correct: bool
        misconception: str

    schema = Verdict.model_json_schema() | {
        "properties": {
            "correct": {"type": "boolean"},
            "misconception": {"type": "string", "maxLength": 10},
        }
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "Verdict", "schema": schema}}
    reply = _chat(client, response_format=fmt, max_tokens=100, seed=3)
    Verdict.model_validate_json(reply.choices[0].message.content)


def test_vllm_structured_outputs_on_completions(client):
    for extra, check in [
        ({"regex": r"[0-9]{2}/[0-9]{2}"}, lambda t: len(t) == 5 and t[2] == "/"),
        ({"choice": ["hint", "question", "answer"]}, lambda t: t in {"hint", "question", "answer"}),
        ({"grammar": 'start: "x = " /[0-9]/'}, lambda t: t.startswith("x = ") and len(t) == 5),
    ]:
        out = client.completions.create(model="tiny", prompt="Solve:", max_tokens=30,
                                        extra_body={"structured_outputs": extra})  # fmt: skip
        assert check(out.choices[0].text), out.choices[0].text


def test_named_and_required_tool_calls(client):
    named = _chat(client, tools=[GRADE, HINT], max_tokens=200, seed=2,
                  tool_choice={"type": "function", "function": {"name": "give_hint"}})  # fmt: skip
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "give_hint" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), HINT["function"]["parameters"])
    required = _chat(client, tools=[GRADE, HINT], tool_choice="required", max_tokens=300, seed=4,
                     parallel_tool_calls=False)  # fmt: skip
    msg, finish = required.choices[0].message, required.choices[0].finish_reason
    assert finish == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (GRADE, HINT)}
    for c in msg.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    # Streamed: the calls arrive as deltas with their index, and end the same way.
    stream = _chat(client, tools=[GRADE, HINT], tool_choice="required", max_tokens=300, seed=4,
                   parallel_tool_calls=False, stream=True)  # fmt: skip
    chunks = list(stream)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, c.function.name, c.function.arguments) for c in msg.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_round_trip_history_is_accepted(client):
    """The assistant's call and the tool's answer go back into the conversation."""
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "give_hint", "arguments": '{"level": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Hint: undo the +2 first."},
    ]  # fmt: skip
    reply = client.chat.completions.create(model="tiny", messages=history, tools=[HINT],
                                           max_tokens=5)  # fmt: skip
    assert reply.usage.prompt_tokens > 0
    tokens = httpx.post(str(client.base_url).removesuffix("v1/") + "tokenize",
                        json={"messages": USER}).json()["count"]  # fmt: skip
    assert reply.usage.prompt_tokens > tokens + 20  # the tools and the calls were rendered


def test_chat_logprobs_streamed_and_not(client):
    reply = _chat(client, logprobs=True, top_logprobs=3, max_tokens=8, temperature=0)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    assert "".join(bytes(e.bytes).decode(errors="replace") for e in content) == (
        reply.choices[0].message.content
    )
    stream = _chat(client, logprobs=True, top_logprobs=3, max_tokens=8, temperature=0, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]


def test_completion_logprobs_match_the_engine(client, offline):
    prompt = [5, 17, 40, 9]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                    ignore_eos=True))[0]  # fmt: skip
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert [len(t) for t in lp.top_logprobs] == [2] * 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_n_choices_share_the_prompt(client, live_server):
    before = live_server.metrics()
    reply = _chat(client, n=4, max_tokens=6, seed=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert reply.usage.completion_tokens == 24
    assert len({c.message.content for c in reply.choices}) > 1  # seeds 5..8 differ
    after = live_server.metrics()
    hits = "tutorserve:prefix_cache_hits_total"
    # Choices 1-3 found the prompt's full blocks computed by choice 0.
    assert after[hits] - before[hits] >= 3 * 16 * (reply.usage.prompt_tokens // 16)
    stream = _chat(client, n=3, max_tokens=4, seed=5, stream=True, extra_body={"ignore_eos": True})
    ends = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert ends == {0, 1, 2}


def test_logit_bias_penalties_min_tokens_stop_token_ids(client, offline):
    prompt = [5, 6, 7, 8]
    forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                       logit_bias={"42": 100})  # fmt: skip
    assert forced.choices[0].text == offline.tokenizer.decode([42] * 5)
    shaped = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "min_tokens": 5,
              "repetition_penalty": 1.3}  # fmt: skip
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={k: v for k, v in shaped.items()
                                                if k not in ("presence_penalty",
                                                             "frequency_penalty")},
                                    presence_penalty=1.5, frequency_penalty=0.5)  # fmt: skip
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, **shaped))[0]
    assert out.choices[0].text == ref.text
    first = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True))[0].token_ids  # fmt: skip
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"stop_token_ids": [first[2]],
                                                    "ignore_eos": True})  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 3


def test_echo(client):
    out = client.completions.create(model="tiny", prompt="Two plus", max_tokens=3, echo=True)
    assert out.choices[0].text.startswith("Two plus")
    stream = client.completions.create(model="tiny", prompt="Two plus", max_tokens=3, echo=True,
                                       stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in stream).startswith("Two plus")


def test_nulls_mean_defaults_as_in_the_openai_api(live_server):
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty",
                           "frequency_penalty", "logprobs", "parallel_tool_calls", "seed",
                           "stop", "top_logprobs", "logit_bias", "response_format"))  # fmt: skip
    r = httpx.post(live_server.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": USER, "max_tokens": 3, **nulls})  # fmt: skip
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
