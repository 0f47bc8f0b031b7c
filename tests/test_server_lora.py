"""LoRA over HTTP: adapters named as models, loaded and unloaded at run time, as in vLLM."""

import httpx
import openai
import pytest

from conftest import start_server
from tutorserve import LLM, SamplingParams
from tutorserve.lora.synth import synth_lora
from tutorserve.models.loader import load_model_config


@pytest.fixture(scope="module")
def loras(synth_llama, tmp_path_factory):
    cfg = load_model_config(synth_llama)
    root = tmp_path_factory.mktemp("server-loras")
    return {
        name: str(synth_lora(root / name, cfg, 8, seed=i, strength=1.5))
        for i, name in enumerate(["algebra", "english", "late"])
    }


@pytest.fixture(scope="module")
def lora_server(synth_llama, loras):
    server = start_server(
        synth_llama, "--lora", f"algebra={loras['algebra']}", "--lora",
        f"english={loras['english']}", "--max-loras", "2",
    )  # fmt: skip
    yield server
    server.stop()


def complete(server, model, prompt="2x + 3 = 7, so x is", **extra):
    return httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
              "ignore_eos": True, **extra},
        timeout=60,
    )  # fmt: skip


def test_adapters_are_models_and_match_offline(synth_llama, loras, lora_server):
    models = httpx.get(lora_server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "algebra", "english"]
    assert models[1]["parent"] == "tiny" and models[1]["root"] == loras["algebra"]
    offline = LLM(synth_llama, dtype="float32", lora_modules={"algebra": loras["algebra"]})
    prompt = "2x + 3 = 7, so x is"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = offline.generate([prompt], params, lora="algebra")[0].text
    base = offline.generate([prompt], params)[0].text
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x")
    got = client.completions.create(model="algebra", prompt=prompt, max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == want != base
    assert complete(lora_server, "tiny").json()["choices"][0]["text"] == base


def test_load_use_and_unload_at_run_time(lora_server, loras):
    url = lora_server.url
    r = httpx.post(url + "/v1/load_lora_adapter",
                   json={"lora_name": "late", "lora_path": loras["late"]})  # fmt: skip
    assert r.status_code == 200 and "late" in r.text
    assert complete(lora_server, "late").status_code == 200
    assert "late" in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200
    r = complete(lora_server, "late")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_lora_errors(lora_server, live_server, loras, tmp_path):
    url = lora_server.url
    cases = [
        ({"lora_name": "algebra", "lora_path": loras["late"]}, 400, "already loaded"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 400, "not found"),
        ({"lora_name": "tiny", "lora_path": loras["late"]}, 400, "base model"),
        ({"lora_name": "", "lora_path": loras["late"]}, 400, "lora_name"),
    ]
    for body, status, text in cases:
        r = httpx.post(url + "/v1/load_lora_adapter", json=body)
        assert r.status_code == status and text in r.text, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404
    r = httpx.post(live_server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "a", "lora_path": loras["late"]})  # fmt: skip
    assert r.status_code == 400 and "not enabled" in r.text
