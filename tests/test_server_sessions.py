"""Sessions over HTTP: a student's history survives a server restart through the disk tier."""

import httpx
import openai

from conftest import start_server


def chat(server, messages, session=None, **extra):
    headers = {"X-Session-Id": session} if session else {}
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, **extra},
        headers=headers,
        timeout=60,
    )
    return r


def test_session_survives_restart(synth_llama, tmp_path):
    kv_dir = str(tmp_path / "kv")
    turn1 = [{"role": "user", "content": "what is 2x + 3 = 7? " * 8}]
    server = start_server(synth_llama, "--kv-disk-dir", kv_dir)
    try:
        first = chat(server, turn1, session="learner-1").json()
    finally:
        server.stop()  # SIGTERM: pending disk writes are finished on the way out
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "I got x = 5"},
    ]
    fresh = start_server(synth_llama, "--kv-disk-gb", "0", "--kv-ram-gb", "0")
    restarted = start_server(synth_llama, "--kv-disk-dir", kv_dir)
    try:
        want = chat(fresh, turn2).json()
        got = chat(restarted, turn2, session="learner-1").json()
        assert got["choices"] == want["choices"]
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] // 16 * 16 > 0
        assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        m = restarted.metrics()
        assert m["tutorserve:kv_tier_hits_total{tier=disk}"] * 16 == cached
        assert m["tutorserve:kv_tier_usage_bytes{tier=disk}"] > 0
        assert m["tutorserve:kv_tier_load_seconds_count{tier=disk}"] == 1
        assert "tutorserve:kv_tier_hits_total{tier=ram}" in m
    finally:
        fresh.stop()
        restarted.stop()


def test_session_id_in_body_and_bad_header(live_server):
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="x")
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        extra_body={"session_id": "s-1", "ignore_eos": True},  # sampled at temperature 1
    )
    assert out.choices[0].finish_reason == "length"
    r = chat(live_server, [{"role": "user", "content": "hi"}], session="x" * 300)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "session_id"
    r = chat(live_server, [{"role": "user", "content": "hi"}], session_id="")
    assert r.status_code == 400
