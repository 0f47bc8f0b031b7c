"""Bad input gets a 4xx with an OpenAI-style error body naming the field; nothing leaks."""

import httpx
import openai
import pytest

from conftest import start_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": "tiny", "messages": USER, "max_tokens": 4, **fields}


CASES = [
    # (path, body, status, param, words in the message)
    (CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages", "list"),
    (CHAT, chat(temperature="hot"), 400, "temperature", "number"),
    (CHAT, chat(max_tokens="5"), 400, "max_tokens", "integer"),
    (CHAT, chat(stream="yes"), 400, "stream", "boolean"),
    (CHAT, chat(model="gpt-17"), 404, "model", "does not exist"),
    (CHAT, chat(max_tokens=-1), 400, "max_tokens", "greater than or equal to 1"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    (CHAT, chat(max_tokens=10**9), 400, "max_tokens", "maximum context length"),
    (CHAT, chat(temperature=2.5), 400, "temperature", "less than or equal to 2"),
    (CHAT, chat(temperature=-0.1), 400, "temperature", "greater than or equal to 0"),
    (CHAT, chat(top_p=0), 400, "top_p", "greater than 0"),
    (CHAT, chat(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    (CHAT, chat(top_k=0), 400, "top_k", "positive"),
    (CHAT, chat(n=2), 400, "n", "n=1"),
    (CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop", "at most 16"),
    (CHAT, chat(stop=[""]), 400, "stop", "non-empty"),
    (CHAT, chat(messages=[]), 400, "messages", "at least 1"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role", "user"),
    (CHAT, chat(messages=[{"content": "hi"}]), 400, "messages.0.role", "required"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": "x " * 5000}]),
        400,
        "messages",
        "maximum context length",
    ),
    (CHAT, chat(stream_options={"include_usage": True}), 400, None, "stream"),
    (CHAT, chat(presence_penalty=0.5), 400, "presence_penalty", "not supported"),
    (CHAT, chat(logprobs=True), 400, "logprobs", "False"),
    (CHAT, {"messages": USER}, 400, "model", "required"),
    (COMPLETIONS, {"model": "tiny", "prompt": [5] * 3000}, 400, "prompt", "maximum context length"),
    (COMPLETIONS, {"model": "tiny", "prompt": [5, 99999]}, 400, "prompt", "token ids"),
    (COMPLETIONS, {"model": "tiny", "prompt": ""}, 400, "prompt", "empty"),
    (COMPLETIONS, {"model": "tiny", "prompt": "a", "echo": True}, 400, "echo", "False"),
]


@pytest.mark.parametrize(
    "path,body,status,param,words", CASES, ids=[f"{c[3]}-{i}" for i, c in enumerate(CASES)]
)
def test_bad_request(live_server, path, body, status, param, words):
    r = httpx.post(live_server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert words.lower() in err["message"].lower()
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "content,words", [(b'{"model": "tiny", "messages": [', "not valid JSON"), (b"", "required")]
)
def test_unparseable_body(live_server, content, words):
    r = httpx.post(
        live_server.url + CHAT, content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert words.lower() in r.json()["error"]["message"].lower()


def test_body_over_cap(live_server):
    big = b'{"model": "tiny", "prompt": "' + b"a" * (5 << 20) + b'"}'
    r = httpx.post(
        live_server.url + COMPLETIONS, content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the cap must hold on the bytes actually read
        yield big[: 1 << 20]
        yield big[1 << 20 :]

    r = httpx.post(
        live_server.url + COMPLETIONS,
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413


def test_bad_requests_leave_nothing_behind(live_server):
    for path, body, *_ in CASES:
        httpx.post(live_server.url + path, json=body, timeout=30)
    m = live_server.metrics()
    assert m["tutorserve:num_requests_running"] == m["tutorserve:num_requests_waiting"] == 0
    assert m["tutorserve:kv_cache_blocks{state=used}"] == 0
    assert httpx.get(live_server.url + "/health").status_code == 200


def test_unknown_route_and_method(live_server):
    r = httpx.get(live_server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(live_server.url + CHAT)
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_no_cors_unless_configured(live_server):
    r = httpx.get(live_server.url + "/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


@pytest.fixture(scope="module")
def keyed_server(synth_llama):
    server = start_server(synth_llama, env={"TUTORSERVE_API_KEY": "s3cret-key"})
    yield server
    server.stop()


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Bearer s3cret-ke", "s3cret-key"])
def test_api_key_required(keyed_server, auth):
    headers = {"Authorization": auth} if auth else {}
    for method, path in [("GET", "/v1/models"), ("POST", CHAT)]:
        r = httpx.request(method, keyed_server.url + path, json=chat(), headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_api_key_accepted(keyed_server):
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="s3cret-key")
    resp = good.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
    assert resp.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # The page and probes stay open; the page asks for the key itself.
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    assert httpx.get(keyed_server.url + "/").status_code == 200
