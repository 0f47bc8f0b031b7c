"""The `tutorserve` command line: real subprocesses, exit codes and messages."""

import json
import subprocess
import sys


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
    from tutorserve.tutor.store import TutorStore

    url = f"sqlite:///{tmp_path / 'tutor.db'}"
    store = TutorStore(url)
    sid = store.create_session("ann", "algebra", "p1").id
    wrong, right = {"correct": False}, {"correct": True}
    store.add_turn(sid, "x=1", "no", wrong, 1, {"k1": {"before": 0.3, "after": 0.2}}, {})
    store.add_turn(sid, "help", "hint", {}, 1, {}, {})  # a question: no mastery change
    store.add_turn(sid, "x=2", "yes", right, 0, {"k1": {"before": 0.2, "after": 0.55}}, {})
    store.close()
    out = tmp_path / "ann.png"
    r = run("tutor", "plot-learner", "ann", "--tutor-db", url, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "| algebra | k1 | 2 | 1 | 0.30 → 0.55 |" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = run("tutor", "plot-learner", "bob", "--tutor-db", url)
    assert r.returncode == 2 and "no learner 'bob'" in r.stderr
