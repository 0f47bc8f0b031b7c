"""The tutor API end to end on a tiny model: sessions, streamed turns with a final event, the
ladder over HTTP, learner profiles, clear 4xx errors, the shared course prefix served from the
prefix cache, and nothing lost across a restart."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator

import httpx
import pytest

from conftest import LiveServer, start_server


@pytest.fixture(scope="module")
def data_dir() -> str:
    return tempfile.mkdtemp(prefix="tutor-data-")


@pytest.fixture(scope="module")
def tutor_server(synth_llama_long: str, data_dir: str) -> Iterator[LiveServer]:
    server = start_server(synth_llama_long, env={"TUTORSERVE_DATA_DIR": data_dir})
    try:
        yield server
    finally:
        server.stop()


def start(server: LiveServer, learner: str, course: str = "algebra") -> dict:
    r = httpx.post(
        server.url + "/v1/tutor/sessions",
        json={"learner_id": learner, "course": course},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def turn(server: LiveServer, session_id: str, message: str) -> list[tuple[str, dict]]:
    """The turn's SSE events, parsed."""
    events = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/tutor/sessions/{session_id}/turns",
        json={"message": message},
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        block: dict[str, str] = {}
        for line in r.iter_lines():
            if not line:
                events.append((block["event"], json.loads(block["data"])))
                block = {}
            else:
                key, _, value = line.partition(": ")
                block[key] = value
    return events


def final_of(events: list[tuple[str, dict]]) -> dict:
    (final,) = [d for name, d in events if name == "final"]
    return final


def test_courses_are_listed(tutor_server):
    data = httpx.get(tutor_server.url + "/v1/tutor/courses").json()["data"]
    by_id = {c["id"]: c for c in data}
    assert set(by_id) >= {"algebra", "english-b1"}
    assert by_id["algebra"]["problems"] >= 10 and by_id["algebra"]["subject"] == "math"
    assert all(k["cefr"] for k in by_id["english-b1"]["kcs"])


def test_a_wrong_answer_twice_climbs_from_hint_to_question_then_a_right_one(tutor_server):
    s = start(tutor_server, "ana")
    assert s["problem"]["id"] == "factor-1" and "x^2 - 5x + 6" in s["problem"]["text"]
    before = {k["kc"]: k["p_mastery"] for k in s["mastery"]}

    first = turn(tutor_server, s["id"], "x = 1 or x = 6")
    names = [n for n, _ in first]
    assert names[0] in ("delta", "reset") and "final" in names and names[-1] == "engage"
    f1 = final_of(first)
    assert (f1["ladder_level"], f1["ladder"]) == (1, "hint")
    assert f1["diagnosis"]["correct"] is False
    assert f1["diagnosis"]["label"] == "misconception"  # the authored "1, 6" mistake
    streamed = ""
    for name, d in first:
        streamed = "" if name == "reset" else streamed + d.get("text", "") * (name == "delta")
    assert streamed == f1["reply"] and f1["reply"].strip()
    changes = f1["mastery_changes"]
    assert set(changes) == {"factoring", "zero-product"}
    assert all(c["after"] < c["before"] == pytest.approx(before[k]) for k, c in changes.items())
    t = f1["timing"]
    assert set(t["steps"]) >= {"diagnose", "retrieve", "explain", "assess"}
    assert t["critical_path_ms"] > 0 and t["sum_of_steps_ms"] > 0

    f2 = final_of(turn(tutor_server, s["id"], "x = 5"))
    assert (f2["ladder_level"], f2["ladder"]) == (2, "guiding question")
    assert "2" not in f2["reply"].replace("^2", "") or "3" not in f2["reply"]

    f3 = final_of(turn(tutor_server, s["id"], "x = 2 or x = 3"))
    assert f3["ladder_level"] == 0 and f3["diagnosis"]["correct"] is True
    assert f3["next_problem"]["id"] != "factor-1"
    assert all(c["after"] > c["before"] for c in f3["mastery_changes"].values())

    profile = httpx.get(tutor_server.url + "/v1/tutor/learners/ana").json()
    (course,) = profile["courses"]
    kcs = {k["kc"]: k for k in course["mastery"]}
    assert kcs["factoring"]["attempts"] == 3 and kcs["factoring"]["errors"] == 2
    assert course["solved"] == 1 and profile["sessions"][0]["turns"] == 3

    stored = httpx.get(f"{tutor_server.url}/v1/tutor/sessions/{s['id']}").json()
    assert [t["ladder_level"] for t in stored["turns"]] == [1, 2, 0]
    assert stored["problem"]["id"] == f3["next_problem"]["id"]


def test_the_course_prefix_is_served_from_the_prefix_cache(tutor_server):
    hits = "tutorserve:prefix_cache_hits_total"
    before = tutor_server.metrics()[hits]
    s = start(tutor_server, "cache-check", "english-b1")
    turn(tutor_server, s["id"], "goed")
    # The diagnose, explain and engage prompts all start with the course's long system
    # message: after the first, each reuses it.
    assert tutor_server.metrics()[hits] - before > 1000


def test_english_profile_has_a_cefr_estimate(tutor_server):
    s = start(tutor_server, "eva", "english-b1")
    assert s["cefr"]["label"].startswith("below")
    final_of(turn(tutor_server, s["id"], "I don't know"))
    profile = httpx.get(tutor_server.url + "/v1/tutor/learners/eva").json()
    cefr = profile["courses"][0]["cefr"]
    assert set(cefr["by_level"]) == {"A2", "B1"}


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("POST", "/v1/tutor/sessions", {"learner_id": "x", "course": "chemistry"}, 400, "course"),
        ("POST", "/v1/tutor/sessions", {"learner_id": "", "course": "algebra"}, 400, "learner_id"),
        ("POST", "/v1/tutor/sessions", {"learner_id": "a b", "course": "algebra"}, 400,
         "learner_id"),
        ("POST", "/v1/tutor/sessions", {"course": "algebra"}, 400, "learner_id"),
        ("POST", "/v1/tutor/sessions/nope/turns", {"message": "2"}, 404, "session_id"),
        ("GET", "/v1/tutor/sessions/nope", None, 404, "session_id"),
        ("GET", "/v1/tutor/learners/nobody", None, 404, "learner_id"),
    ],
)  # fmt: skip
def test_bad_requests_get_clear_errors(tutor_server, method, path, body, status, param):
    r = httpx.request(method, tutor_server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_an_empty_message_and_a_second_turn_in_flight_are_refused(tutor_server):
    s = start(tutor_server, "busy")
    url = f"{tutor_server.url}/v1/tutor/sessions/{s['id']}/turns"
    r = httpx.post(url, json={"message": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "message"

    # While the first turn streams (its verdict arrives before the model's reply), a second one
    # on the same session is refused; the first still completes.
    with httpx.stream("POST", url, json={"message": "x = 4"}, timeout=120) as first:
        lines = first.iter_lines()
        assert next(lines) == "event: delta"
        second = httpx.post(url, json={"message": "x = 9"}, timeout=30)
        rest = "\n".join(lines)
    assert second.status_code == 409, second.text
    assert second.json()["error"]["code"] == "session_busy"
    assert "event: final" in rest
    stored = httpx.get(f"{tutor_server.url}/v1/tutor/sessions/{s['id']}").json()
    assert [t["ladder_level"] for t in stored["turns"]] == [1]


def test_learners_and_sessions_survive_a_restart(synth_llama_long, tmp_path):
    env = {"TUTORSERVE_DATA_DIR": str(tmp_path)}
    server = start_server(synth_llama_long, env=env)
    try:
        s = start(server, "rosa")
        f = final_of(turn(server, s["id"], "x = 7"))
    finally:
        server.stop()
    again = start_server(synth_llama_long, env=env)
    try:
        profile = httpx.get(again.url + "/v1/tutor/learners/rosa").json()
        kcs = {k["kc"]: k for k in profile["courses"][0]["mastery"]}
        for kc, change in f["mastery_changes"].items():
            assert kcs[kc]["p_mastery"] == pytest.approx(change["after"])
            assert kcs[kc]["errors"] == 1
        # The same session goes on, one rung up the ladder.
        assert final_of(turn(again, s["id"], "x = 8"))["ladder_level"] == 2
    finally:
        again.stop()


def test_agents_can_run_on_another_openai_compatible_server(synth_llama_long):
    """--tutor-llm-url: the tutor's model calls go to the other server, over its OpenAI API."""
    model_server = start_server(synth_llama_long)
    tutor = None
    try:
        tutor = start_server(
            synth_llama_long,
            "--tutor-llm-url", model_server.url + "/v1", "--tutor-llm-model", "tiny",
        )  # fmt: skip
        before = model_server.metrics()["tutorserve:prompt_tokens_total"]
        s = start(tutor, "remote", "english-b1")
        final = final_of(turn(tutor, s["id"], "I dunno, maybe goed"))
        assert final["ladder_level"] == 1 and "explain" in final["timing"]["steps"]
        assert model_server.metrics()["tutorserve:prompt_tokens_total"] > before + 1000
        assert tutor.metrics()["tutorserve:prompt_tokens_total"] == 0
    finally:
        model_server.stop()
        if tutor is not None:
            tutor.stop()


def test_tutor_costs_in_metrics_add_up_to_the_engines_counters_and_health_shows_breakers(
    tutor_server,
):
    def totals() -> dict[str, float]:
        m = tutor_server.metrics()
        spent = [(name, v) for name, v in m.items() if name.startswith("tutorserve:tutor_tokens_")]
        tutor = {k: sum(v for name, v in spent if f"kind={k}," in name and "_total" in name)
                 for k in ("prompt", "generated")}  # fmt: skip
        engine = {"prompt": m["tutorserve:prompt_tokens_total"],
                  "generated": m["tutorserve:generation_tokens_total"]}  # fmt: skip
        return {"tutor": tutor, "engine": engine}

    before = totals()
    # English gaps: the tiny model's bytes never spell the gap's word, so no reply is cut off
    # (an abandoned generation's last tokens reach the engine's counters only).
    s = httpx.post(
        tutor_server.url + "/v1/tutor/sessions",
        json={"learner_id": "costs", "course": "english-b1", "school": "north"},
        timeout=30,
    ).json()
    for message in ("wented", "watched"):
        turn(tutor_server, s["id"], message)
    after = totals()
    for kind in ("prompt", "generated"):
        spent = after["tutor"][kind] - before["tutor"][kind]
        assert spent > 0 and spent == after["engine"][kind] - before["engine"][kind], kind
    assert any("school=north" in k for k in tutor_server.metrics())
    health = httpx.get(tutor_server.url + "/health").json()
    (model,) = health["tutor"]["models"].values()
    assert model["state"] == "closed" and set(model["tiers"]) == {"small", "large"}
