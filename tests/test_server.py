"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from conftest import start_server
from tutorserve import LLM, SamplingParams
from tutorserve.bench.client import scrape_counters

NO_EOS = {"ignore_eos": True}
COMPLETIONS_PATH = "/v1/completions"
QUESTIONS = [f"Student {i}: why is {i} squared equal to {i * i}?" for i in range(64)]


@pytest.fixture(scope="module")
def offline(synth_llama):
    """The same model run offline: the reference for what the server must return."""
    return LLM(synth_llama, dtype="float32", num_kv_blocks=2048)


def chat_ids(offline, question):
    text = offline.render_chat([{"role": "user", "content": question}])
    return offline.tokenizer.encode(text, add_special_tokens=False)


def greedy(offline, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.text for o in offline.generate(prompts, params)]


def test_models_health_openapi(live_server):
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny"]
    health = httpx.get(live_server.url + "/health").json()
    assert health["status"] == "ok" and health["tutor"]["models"]["tiny"]["state"] == "closed"
    paths = httpx.get(live_server.url + "/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics"} <= set(paths)
    assert {"/tokenize", "/detokenize"} <= set(paths)


def tokenize(server, **body):
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "text", [QUESTIONS[3], "naïve café, ünïcode ✓ and 字", "  spaced\n\tout  "]
)
def test_tokenize_detokenize_round_trip(live_server, text):
    out = tokenize(live_server, prompt=text, return_token_strs=True)
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) > 0
    assert (
        out["max_model_len"]
        == httpx.get(live_server.url + "/v1/models").json()["data"][0]["max_model_len"]
    )
    assert tokenize(live_server, model="tiny", prompt=text)["token_strs"] is None
    r = httpx.post(live_server.url + "/detokenize", json={"model": "tiny", "tokens": out["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}


def test_tokenize_counts_a_conversation_as_chat_completions_reads_it(live_server):
    messages = [
        {"role": "system", "content": "You are a patient maths tutor."},
        {"role": "user", "content": QUESTIONS[4]},
    ]
    out = tokenize(live_server, model="tiny", messages=messages)
    assert out["count"] == len(out["tokens"])
    r = httpx.post(
        live_server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 1},
        timeout=30,
    )
    assert r.json()["usage"]["prompt_tokens"] == out["count"]
    # Without the assistant's header, the same conversation is a strict prefix of it.
    bare = tokenize(live_server, messages=messages, add_generation_prompt=False)
    assert bare["count"] < out["count"] and out["tokens"][: bare["count"]] == bare["tokens"]


def test_sync_client_chat_matches_offline_engine(live_server, offline):
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    ids = chat_ids(offline, QUESTIONS[0])
    (want,) = greedy(offline, [ids], 12)

    resp = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    assert resp.choices[0].message.content == want
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), 12)
    assert resp.usage.total_tokens == len(ids) + 12

    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body=NO_EOS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 12
    # The second identical prompt reuses the first one's full KV blocks.
    assert usage.prompt_tokens_details.cached_tokens == len(ids) // 16 * 16 > 0


def test_sync_client_completions(live_server, offline):
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused")
    prompt = "The derivative of x squared is"
    (want,) = greedy(offline, [prompt], 10)
    resp = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0, extra_body=NO_EOS
    )
    assert resp.choices[0].text == want
    assert resp.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body=NO_EOS,
            stream=True,
        )
    ]
    assert "".join(pieces) == want and len([p for p in pieces if p]) > 1
    # Token-id prompts are accepted as well.
    ids = offline.tokenizer.encode(prompt)
    resp = client.completions.create(
        model="tiny", prompt=ids, max_tokens=10, temperature=0, extra_body=NO_EOS
    )
    assert resp.choices[0].text == want


def test_async_client_stream_and_stop_string(live_server, offline):
    async def run():
        client = openai.AsyncOpenAI(base_url=live_server.url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": QUESTIONS[1]}]
        full = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=16, temperature=0, extra_body=NO_EOS
        )
        stop = full.choices[0].message.content[5:8]
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=16,
            temperature=0,
            extra_body=NO_EOS,
            stop=[stop],
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        return full.choices[0].message.content, stop, text

    full, stop, text = asyncio.run(run())
    assert text == full[: full.index(stop)]


def test_64_concurrent_streams(live_server, offline):
    prompts = [chat_ids(offline, q) for q in QUESTIONS]
    lengths = [4 + i % 21 for i in range(64)]
    want = [greedy(offline, [p], n)[0] for p, n in zip(prompts, lengths, strict=True)]

    async def one(client, question, n):
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": question}],
            max_tokens=n,
            temperature=0,
            extra_body=NO_EOS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1]

    async def run():
        client = openai.AsyncOpenAI(base_url=live_server.url + "/v1", api_key="unused")
        return await asyncio.gather(
            *(one(client, q, n) for q, n in zip(QUESTIONS, lengths, strict=True))
        )

    results = asyncio.run(run())
    for (text, last), p, n, w in zip(results, prompts, lengths, want, strict=True):
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(p), n)
        assert text == w


def _wait_idle(server, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["tutorserve:num_requests_running"] == m["tutorserve:num_requests_waiting"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"server still busy after {timeout} s: {m}")


def test_cancelled_streams_free_their_blocks(live_server):
    before = live_server.metrics()

    async def start_and_leave(client, i):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": QUESTIONS[i]}],
            "max_tokens": 1500,
            "stream": True,
            **NO_EOS,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 4:
                    return  # leaving the block closes the connection mid-stream

    async def run():
        async with httpx.AsyncClient(base_url=live_server.url, timeout=60) as client:
            await asyncio.gather(*(start_and_leave(client, i) for i in range(16)))

    asyncio.run(run())
    after = _wait_idle(live_server)
    assert after["tutorserve:kv_cache_blocks{state=used}"] == 0
    aborted = "tutorserve:request_success_total{finished_reason=abort}"
    assert after.get(aborted, 0) - before.get(aborted, 0) == 16
    generated = (
        after["tutorserve:generation_tokens_total"] - before["tutorserve:generation_tokens_total"]
    )
    assert generated < 16 * 1500 / 4  # they were stopped, not run to the end


@pytest.fixture(scope="module")
def limited_server(synth_llama):
    server = start_server(
        synth_llama, "--max-waiting", "4", "--max-num-seqs", "2", "--max-requests-per-user", "2"
    )
    yield server
    server.stop()


def test_overload_gets_429_and_accepted_requests_finish(limited_server):
    async def one(client, i):
        body = {"model": "tiny", "prompt": QUESTIONS[i], "max_tokens": 48, **NO_EOS}
        return await client.post("/v1/completions", json=body)

    async def run():
        async with httpx.AsyncClient(base_url=limited_server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    responses = asyncio.run(run())
    refused = [r for r in responses if r.status_code == 429]
    done = [r for r in responses if r.status_code == 200]
    assert refused and done and len(refused) + len(done) == 32
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and "capacity" in err["message"]
    for r in done:
        assert r.json()["usage"]["completion_tokens"] == 48
    m = _wait_idle(limited_server)
    assert m["tutorserve:request_rejected_total{reason=queue_full}"] == len(refused)
    assert m["tutorserve:kv_cache_blocks{state=used}"] == 0
    assert httpx.get(limited_server.url + "/health").status_code == 200


def test_per_user_cap(limited_server):
    async def run():
        async with httpx.AsyncClient(base_url=limited_server.url, timeout=60) as client:

            def body(user, n=400):
                return {
                    "model": "tiny",
                    "prompt": "hello",
                    "max_tokens": n,
                    "stream": True,
                    "user": user,
                    **NO_EOS,
                }

            async with (
                client.stream("POST", "/v1/completions", json=body("alice")) as a1,
                client.stream("POST", "/v1/completions", json=body("alice")) as a2,
            ):
                assert a1.status_code == a2.status_code == 200
                third = await client.post("/v1/completions", json=body("alice", 4))
                other = await client.post("/v1/completions", json=body("bob", 4))
            # Both of alice's streams are closed now: her slots are free again.
            again = await client.post("/v1/completions", json=body("alice", 4))
            return third, other, again

    third, other, again = asyncio.run(run())
    assert third.status_code == 429 and "alice" in third.json()["error"]["message"]
    assert "retry-after" in third.headers
    assert other.status_code == 200 and again.status_code == 200
    _wait_idle(limited_server)


def test_priority_orders_waiting_requests(limited_server):
    """Two blockers fill both running slots; of two waiting requests, the lower priority value
    is admitted when the first slot frees, ahead of the one that arrived earlier. Each request
    is sent once the server shows the one before it running or waiting, so the order does not
    depend on how fast the model decodes. The waiting requests are long enough that the first
    admitted ends 100 steps before the other (with 4 tokens each, the responses of two requests
    ending a few steps apart could reach the client in either order)."""

    async def until(name: str, value: int) -> None:
        while (await asyncio.to_thread(limited_server.metrics))[f"tutorserve:{name}"] < value:
            await asyncio.sleep(0.01)

    async def run():
        async with httpx.AsyncClient(base_url=limited_server.url, timeout=120) as client:
            finished = []

            async def send(name, n, priority):
                body = {
                    "model": "tiny",
                    "prompt": name,
                    "max_tokens": n,
                    "priority": priority,
                    **NO_EOS,
                }
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                finished.append(name)

            sent = [asyncio.create_task(send("blocker-short", 1000, 0))]
            sent.append(asyncio.create_task(send("blocker-long", 1500, 0)))
            await until("num_requests_running", 2)
            sent.append(asyncio.create_task(send("early-casual", 100, 5)))
            await until("num_requests_waiting", 1)
            sent.append(asyncio.create_task(send("late-urgent", 100, -5)))
            await until("num_requests_waiting", 2)
            assert not finished, "a blocker ended before both waiting requests were queued"
            await asyncio.gather(*sent)
            return finished

    order = asyncio.run(run())
    assert order.index("late-urgent") < order.index("early-casual")


def test_sse_wire_format(live_server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        **NO_EOS,
    }
    with httpx.stream("POST", live_server.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert len({p["id"] for p in payloads}) == 1


def test_client_leaving_a_non_streaming_request_aborts_it(live_server):
    before = live_server.metrics()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1800, **NO_EOS}
    with pytest.raises(httpx.ReadTimeout):
        # Leave early: the tiny model writes the 1,800 tokens in about a second.
        httpx.post(live_server.url + COMPLETIONS_PATH, json=body, timeout=0.2)
    after = _wait_idle(live_server)
    aborted = "tutorserve:request_success_total{finished_reason=abort}"
    assert after[aborted] - before.get(aborted, 0) == 1
    assert after["tutorserve:kv_cache_blocks{state=used}"] == 0


def test_metrics_count_one_request(live_server, offline):
    before = live_server.metrics()
    ids = offline.tokenizer.encode("Metrics, please: what is a prime number?")
    body = {"model": "tiny", "prompt": ids, "max_tokens": 5, **NO_EOS}
    assert httpx.post(live_server.url + COMPLETIONS_PATH, json=body).status_code == 200
    after = _wait_idle(live_server)

    def delta(name):
        return after[name] - before.get(name, 0)

    assert delta("tutorserve:prompt_tokens_total") == len(ids)
    assert delta("tutorserve:generation_tokens_total") == 5
    assert delta("tutorserve:prefix_cache_queries_total") == len(ids)
    assert delta("tutorserve:request_success_total{finished_reason=length}") == 1
    # One step computes the prompt and samples the first token; four more decode the rest.
    assert delta("tutorserve:engine_steps_total") == 5
    step_s, e2e_s = (
        delta(f"tutorserve:{n}")
        for n in ("engine_step_seconds_total", "e2e_request_latency_seconds_sum")
    )
    assert 0 < step_s < e2e_s
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert delta(f"tutorserve:{hist}_seconds_count") == 1
        assert delta(f"tutorserve:{hist}_seconds_sum") > 0
    assert after["tutorserve:kv_cache_usage_perc"] == 0
    assert after["tutorserve:kv_cache_blocks{state=cached}"] >= len(ids) // 16


def test_speculative_decoding_over_http_matches_and_is_counted(synth_llama):
    """`--speculative suffix`: the same greedy reply as offline without speculation, and the
    drafts counted in /metrics."""
    prompt = "ab ab ab ab ab ab ab ab"
    want = LLM(synth_llama, dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )[0]
    args = ["--dtype", "float32", "--speculative", "suffix", "--speculative-backoff", "fixed"]
    server = start_server(synth_llama, *args)
    try:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, **NO_EOS}
        r = httpx.post(server.url + COMPLETIONS_PATH, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        m = server.metrics()
        drafted = m["tutorserve:spec_decode_num_draft_tokens_total"]
        assert drafted > 0
        accepted = m["tutorserve:spec_decode_num_accepted_tokens_total"]
        assert accepted > 0
        per_pos = [v for k, v in m.items() if "accepted_tokens_per_pos_total{position=" in k]
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
        # what `bench serve` reads of them (vLLM's names end alike), per-position counts apart
        scraped = scrape_counters(server.url)
        assert scraped["spec_decode_num_draft_tokens_total"] == drafted
        assert scraped["spec_decode_num_accepted_tokens_total"] == accepted
    finally:
        server.stop()


def test_the_server_freezes_what_start_up_built_while_it_serves(synth_llama):
    """Start-up's objects (model, libraries) are kept out of the collector's full passes while
    the app runs, and handed back when it stops, so an app built again is not pinned."""
    import gc

    from fastapi.testclient import TestClient

    from tutorserve.config import EngineConfig
    from tutorserve.engine.async_engine import AsyncEngine
    from tutorserve.engine.engine import LLMEngine
    from tutorserve.server.app import ServerSettings, build_app

    config = EngineConfig.from_kwargs(model=synth_llama, dtype="float32")
    app = build_app(AsyncEngine(lambda: LLMEngine(config)), ServerSettings("tiny"))
    assert gc.get_freeze_count() == 0
    with TestClient(app) as client:
        assert gc.get_freeze_count() > 10_000
        assert client.get("/health").status_code == 200
    assert gc.get_freeze_count() == 0
