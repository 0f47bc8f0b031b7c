"""The `tutorserve` command line: real subprocesses, exit codes and messages."""

import json
import subprocess
import sys

import pytest


def run(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "tutorserve.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=300,
    )


def test_synth_model_then_generate(tmp_path):
    out = tmp_path / "m"
    r = run(
        "synth-model",
        str(out),
        "--arch",
        "qwen2",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "300",
    )
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["num_key_value_heads"] == 2
    assert cfg["vocab_size"] == 300
    r = run(
        "generate",
        "--model",
        str(out),
        "--prompt",
        "hello",
        "--max-tokens",
        "5",
        "--dtype",
        "float32",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_models_lists_default():
    r = run("models")
    assert r.returncode == 0
    assert r.stdout.startswith("smollm2-135m-instruct\t") and ".gguf" in r.stdout


def test_errors_exit_nonzero_with_message(tmp_path):
    r = run("generate", "--model", "no-such-model", "--prompt", "hi")
    assert r.returncode == 2
    assert "error: unknown model 'no-such-model'" in r.stderr
    r = run("generate", "--prompt", "hi", "--top-p", "2")
    assert r.returncode == 2 and "top_p" in r.stderr
    r = run("synth-model", str(tmp_path / "x"), "--hidden", "30", "--heads", "4")
    assert r.returncode == 2 and "divisible" in r.stderr


def test_chat_streams_a_reply(synth_llama):
    r = run(
        "chat",
        "--model",
        synth_llama,
        "--max-tokens",
        "6",
        "--dtype",
        "float32",
        stdin="hello tutor\nand again\n",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("tutor> ") == 2


def test_serve_refuses_bad_options(synth_llama, live_server, tmp_path):
    r = run("serve", "--model", "no-such-model")
    assert r.returncode == 2 and "error: unknown model 'no-such-model'" in r.stderr
    r = run("serve", "--model", synth_llama, "--max-waiting", "0")
    assert r.returncode == 2 and "--max-waiting" in r.stderr
    r = run("serve", "--model", synth_llama, "--kv-ram-gb", "-1")
    assert r.returncode == 2 and "kv_ram_bytes" in r.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = run("serve", "--model", synth_llama, "--kv-disk-dir", str(blocker / "kv"))
    assert r.returncode == 2 and "KV disk tier folder" in r.stderr
    r = run("serve", "--model", synth_llama, "--courses", str(tmp_path / "no-such-course"))
    assert r.returncode == 2 and "course folder" in r.stderr and "does not exist" in r.stderr
    r = run("serve", "--model", synth_llama, "--tutor-db", "nonsense://x")
    assert r.returncode == 2 and "tutor store" in r.stderr
    port = live_server.url.rsplit(":", 1)[1]
    r = run("serve", "--model", synth_llama, "--num-kv-blocks", "64", "--port", port)
    assert r.returncode != 0 and "address already in use" in r.stderr


def test_check_course_validates_course_folders(tmp_path):
    from tutorserve.tutor.courses import BUILTIN

    r = run("tutor", "check-course", str(BUILTIN / "algebra"), str(BUILTIN / "english-b1"))
    assert r.returncode == 0, r.stderr
    assert "course 'algebra' (math) is valid: 5 KCs" in r.stdout
    assert "CEFR levels A2, B1" in r.stdout
    r = run("tutor", "check-course", str(tmp_path))
    assert r.returncode == 2 and f"error: {tmp_path / 'course.yaml'} is missing" in r.stderr


def test_plot_learner_draws_mastery_from_the_store(tmp_path):
    from tutorserve.tutor.store import Attempt, KCState, TutorStore

    url = f"sqlite:///{tmp_path / 'tutor.db'}"
    store = TutorStore(url)
    sid = store.create_session("ann", "algebra", "p1").id
    wrong, right = {"correct": False}, {"correct": True}
    down = Attempt({"k1": KCState(0.2)}, {"k1": {"before": 0.3, "after": 0.2}}, False, None)
    up = Attempt({"k1": KCState(0.55)}, {"k1": {"before": 0.2, "after": 0.55}}, True, None)
    store.add_turn(sid, "x=1", "no", wrong, 1, {}, down)
    store.add_turn(sid, "help", "hint", {}, 1, {})  # a question: no mastery change
    store.add_turn(sid, "x=2", "yes", right, 0, {}, up)
    store.close()
    out = tmp_path / "ann.png"
    r = run("tutor", "plot-learner", "ann", "--tutor-db", url, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "| algebra | k1 | 2 | 1 | 0.30 → 0.55 |" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = run("tutor", "plot-learner", "bob", "--tutor-db", url)
    assert r.returncode == 2 and "no learner 'bob'" in r.stderr


def test_engine_options_are_declared_once_and_round_trip_through_the_cli(monkeypatch):
    """Every CLI engine flag comes from EngineConfig's declaration: defaults match the API's
    (but for the disk tier, on by default on the CLI), GiB become bytes, --no-prefix-caching
    turns caching off, --lora NAME=PATH builds the adapter map."""
    import argparse
    import dataclasses

    from tutorserve.config import EngineConfig, add_engine_args, engine_options

    monkeypatch.setenv("TUTORSERVE_KV_DIR", "/tmp/kv-here")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    defaults = engine_options(p.parse_args([]))
    api = {f.name: getattr(EngineConfig(), f.name) for f in dataclasses.fields(EngineConfig)}
    cli_only = {"kv_disk_bytes": 4 << 30, "kv_disk_dir": "/tmp/kv-here"}
    assert defaults == {k: v for k, v in api.items() if k in defaults} | cli_only
    assert "max_bypass" not in defaults  # declared without a flag
    opts = engine_options(p.parse_args([
        "--kv-cache-gb", "0.5", "--no-prefix-caching", "--lora", "a=/x", "--lora", "b=/y",
        "--dtype", "float32", "--max-num-seqs", "3",
    ]))  # fmt: skip
    assert opts["kv_cache_bytes"] == 1 << 29 and opts["enable_prefix_caching"] is False
    assert opts["lora_modules"] == {"a": "/x", "b": "/y"} and opts["max_num_seqs"] == 3
    EngineConfig.from_kwargs(**opts)  # every option the CLI gives is one the engine takes
    with pytest.raises(ValueError, match="--lora takes NAME=PATH"):
        engine_options(p.parse_args(["--lora", "nopath"]))
    only = argparse.ArgumentParser()
    add_engine_args(only, only=("max_num_seqs",))
    assert engine_options(only.parse_args([])) == {"max_num_seqs": 64}


def test_bench_roofline_measures_decode_against_the_bound_of_the_bytes_as_loaded(synth_llama):
    r = run(
        "bench", "roofline", "--model", synth_llama, "--dtype", "float32",
        "--quantization", "int4", "--measure", "--batches", "1,3", "--steps", "2",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    # 266 kB: Q4_1 qkv, o and gate/up, float32 down, norms and LM head (test_quant.py counts it)
    assert "quantization int4) a decode step reads 0.3 MB of weights" in r.stdout
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| ")]
    assert [int(row[0]) for row in rows[1:]] == [1, 3]
    for batch, context, bound, ms, tok_s, share in rows[1:]:
        assert float(ms) > 0 and int(context) > 100
        # ms is printed to 0.1: tok/s lies within what the rounded step time allows
        slow, fast = (int(batch) / ((float(ms) + d) / 1000) for d in (0.05, -0.05))
        assert slow - 1 <= int(tok_s) <= fast + 1
        assert float(share.strip(" %")) == pytest.approx(
            100 * int(tok_s) / float(bound), rel=0.05, abs=1
        )
