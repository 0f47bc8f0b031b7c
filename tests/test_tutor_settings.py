"""`serve --tutor-config`: the file's checks, and a live server whose small tier is its own
engine and whose large tier is a second engine in the same process, with the learner-state
policy, the reply cache and a school's quota — over HTTP and over the voice WebSocket."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import wave
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from conftest import start_server
from test_server_tutor import final_of, turn
from test_voice import say
from tutorserve.tutor.breaker import BreakerConfig
from tutorserve.tutor.quotas import Limits, OverQuota
from tutorserve.tutor.settings import TutorSettings
from tutorserve.tutor.tiers import LearnerState, Tier, Uniform


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tutor.yaml"
    path.write_text(text)
    return path


def test_every_section_reaches_the_object_that_uses_it(tmp_path):
    s = TutorSettings.load(write(tmp_path, """
policy: learner-state
policy_options: {stuck_after: 3}
models:
  small: {served: true, adapter: persona}
  large: {url: "http://models:8000/v1", model: qwen, api_key_env: LARGE_KEY}
reply_cache: {max_entries: 10}
breaker: {slow_s: 5, min_calls: 2}
quotas:
  default: {turns_per_minute: 30, over: degrade, degrade_to: small}
  schools: {north: {turns_per_day: 5000, priority: -1}}
"""))  # fmt: skip
    assert s.tiering() == LearnerState(stuck_after=3)
    assert s.models[Tier.SMALL].adapter == "persona" and s.models[Tier.LARGE].model == "qwen"
    assert s.breaker == BreakerConfig(slow_s=5, min_calls=2)
    quotas = s.quota_book()
    assert quotas is not None
    assert quotas.default == Limits(turns_per_minute=30, over=OverQuota.DEGRADE,
                                    degrade_to=Tier.SMALL)  # fmt: skip
    assert quotas.limits["north"] == Limits(turns_per_day=5000, priority=-1)
    assert s.reply_cache is not None and s.reply_cache.max_entries == 10


def test_without_a_file_one_model_serves_every_agent():
    s = TutorSettings.plain()
    assert s.tiering() == Uniform() and s.reply_cache is None and s.quota_book() is None
    assert list(s.models) == [Tier.LARGE] and s.models[Tier.LARGE].served


def test_a_file_without_a_policy_gets_the_learner_state_default(tmp_path):
    s = TutorSettings.load(write(tmp_path, "reply_cache: {}"))
    assert s.tiering() == LearnerState() and s.models[Tier.LARGE].served


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("models: {authored: {served: true}}", "authored is text"),
        ("models: {small: {served: true, url: 'http://x/v1'}}", "exactly one of"),
        ("models: {small: {url: 'http://x/v1', adapter: a}}", "adapter do not go with url"),
        ("models: {small: {path: /m, engine: {dtypo: x}}}", "unknown engine option(s): dtypo"),
        ("policy: clever", "policy must be one of uniform, learner-state"),
        (
            "{policy: uniform, policy_options: {at: 2, stuck_after: 3}}",
            "policy uniform has no option(s) stuck_after",
        ),
        ("breaker: {slow: 3}", "breaker.slow"),
        ("breaker: {slow_s: -1}", "positive seconds"),
        ("quotas: {schools: {north: {turns_per_day: 0}}}", "at least 1"),
        ("quotas: {default: {over: sometimes}}", "quotas.default.over"),
        ("reply_cachee: {}", "reply_cachee"),
        ("models: [", "tutor config"),
    ],
)
def test_a_wrong_file_is_refused_naming_the_field(tmp_path, text, says):
    with pytest.raises(ValueError, match="tutor config") as e:
        TutorSettings.load(write(tmp_path, text))
    assert says in str(e.value)


def test_serve_refuses_a_wrong_config_before_loading_a_model(tmp_path):
    def serve(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "tutorserve.cli", "serve", "--model", "no-such-model", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    r = serve("--tutor-config", str(write(tmp_path, "policy: clever")))
    assert r.returncode == 2 and "policy must be one of" in r.stderr, r.stderr
    assert "unknown model" not in r.stderr  # refused before the model was looked up
    r = serve("--tutor-config", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "missing.yaml" in r.stderr
    r = serve("--tutor-config", str(write(tmp_path, "{}")), "--tutor-llm-url", "http://x/v1")
    assert r.returncode == 2 and "give one of them" in r.stderr


def test_a_server_with_two_engines_tiers_caches_and_enforces_quotas(synth_llama_long, tmp_path):
    config = write(tmp_path, f"""
policy: learner-state
models:
  small: {{served: true}}
  large: {{path: {synth_llama_long}, engine: {{dtype: float32, num_kv_blocks: 512}}}}
reply_cache: {{}}
quotas:
  schools: {{north: {{turns_per_day: 3}}}}
""")  # fmt: skip
    large = Path(synth_llama_long).stem
    server = start_server(synth_llama_long, "--tutor-config", str(config))
    try:
        health = httpx.get(server.url + "/health").json()["tutor"]["models"]
        assert {name: m["tiers"] for name, m in health.items()} == {
            "tiny": ["small"],
            large: ["large"],
        }

        def north_session(learner: str, course: str) -> str:
            r = httpx.post(
                server.url + "/v1/tutor/sessions",
                timeout=30,
                json={"learner_id": learner, "course": course, "school": "north"},
            )
            return r.json()["id"]  # fmt: skip

        served_before = server.metrics()["tutorserve:prompt_tokens_total"]
        # English gaps: the tiny model never spells the gap's word, so no reply is cut off.
        first, second = (final_of(turn(server, north_session(learner, "english-b1"), "wented"))
                         for learner in ("ana", "ben"))  # fmt: skip
        # A wrong answer: diagnose on the small tier (this engine), the hint on the large one
        # (the second engine); the same answer to the same problem is then a cache hit.
        assert first["ladder_level"] == 1
        assert (first["tiers"]["diagnose"], first["tiers"]["explain"]) == ("small", "large")
        assert second["tiers"]["diagnose"] == second["tiers"]["explain"] == "cache"
        spent = server.metrics()["tutorserve:prompt_tokens_total"] - served_before
        assert 0 < spent < first["usage"]["prompt_tokens"]  # the hint's prompt went elsewhere
        assert second["usage"]["prompt_tokens"] == 0

        # North's third turn of the day is its last; a fourth is refused, by HTTP and by voice.
        sid = north_session("cy", "algebra")
        assert final_of(turn(server, sid, "x = 2 or x = 3"))["ladder_level"] == 0
        r = httpx.post(f"{server.url}/v1/tutor/sessions/{sid}/turns", json={"message": "2, 3"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "quota_exceeded"
        with wave.open(io.BytesIO(say("the answer is two and three"))) as w:
            pcm = w.readframes(w.getnframes())
        with connect(server.url.replace("http", "ws") + f"/v1/tutor/sessions/{sid}/voice",
                     open_timeout=10) as ws:  # fmt: skip
            ws.send(pcm)
            ws.send(json.dumps({"type": "end"}))
            events = [json.loads(ws.recv(timeout=60))]
            while events[-1]["event"] != "done":
                events.append(json.loads(ws.recv(timeout=60)))
        (refused,) = [e for e in events if e["event"] == "error"]
        assert refused["status"] == 429 and refused["retry_after"] >= 1
        assert "final" not in [e["event"] for e in events]
    finally:
        server.stop()


def test_the_documented_example_is_a_valid_file(tmp_path):
    doc = (Path(__file__).parents[1] / "docs" / "tutor-config.md").read_text("utf-8")
    example = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    s = TutorSettings.load(write(tmp_path, example))
    assert s.models[Tier.LARGE].engine["dtype"] == "bfloat16" and s.breaker.slow_s == 10
    assert s.quota_book().limits["exam-week"].priority == -1  # type: ignore[union-attr]
