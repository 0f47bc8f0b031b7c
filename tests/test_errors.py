"""Bad input raises a clear ValueError and leaves no work or blocks behind."""

import shutil

import pytest

from tutorserve import LLM, SamplingParams
from tutorserve.models.gguf_file import GGUFModel
from tutorserve.models.registry import resolve


@pytest.fixture(scope="module")
def llm(synth_llama):
    return LLM(synth_llama, dtype="float32", max_model_len=128)


def assert_clean(llm):
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt is empty"),
        ([], "no prompts given"),
        ([[]], "prompt is empty"),
        ([list(range(3, 200))], "context length is 128"),
        ([[3, 4, 99999]], "outside the vocabulary"),
        ([[3, -1]], "outside the vocabulary"),
        ([["a", 1]], "string or a list of token ids"),
    ],
)
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=4))
    assert_clean(llm)


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=4))
    assert_clean(llm)
    assert llm.generate("fine prompt", SamplingParams(max_tokens=2))[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"stop": ["x"] * 17}, "stop strings"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_and_options(synth_llama):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(synth_llama, not_an_option=1)
    with pytest.raises(ValueError, match="exceeds the KV budget"):
        LLM(synth_llama, num_kv_blocks=4, max_model_len=1024)
    with pytest.raises(ValueError, match="block_size"):
        LLM(synth_llama, block_size=12)


def test_mismatched_checkpoint(synth_llama, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(synth_llama, bad)
    cfg = (bad / "config.json").read_text().replace('"hidden_size": 64', '"hidden_size": 32')
    (bad / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="shape"):
        LLM(str(bad))


def test_corrupt_and_truncated_gguf(tmp_path):
    real = resolve("smollm2-135m-instruct")
    data = real.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("definitely not a model\n" * 100)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:4096])
    for path in (truncated, garbage, not_gguf, header_only):
        with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
            GGUFModel(path)
        with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
            LLM(str(path))
