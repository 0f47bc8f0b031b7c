import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tutorserve.kernels import isa
from tutorserve.kernels.build import BF16_DOT_LEVELS
from tutorserve.layers.attention.cpu_kernel import CPUKernelBackend
from tutorserve.layers.attention.gather import GatherBackend
from tutorserve.models.synth import SynthSpec, synth_model

# CLI subprocesses default to a disk tier and a tutor store in the home folder; tests keep
# theirs in temporary folders.
os.environ["TUTORSERVE_KV_DIR"] = tempfile.mkdtemp(prefix="tutorserve-kv-")
os.environ["TUTORSERVE_DATA_DIR"] = tempfile.mkdtemp(prefix="tutorserve-data-")


def _kernel_level(level):
    runs = isa.cpu_levels()
    if level not in runs:
        pytest.skip(f"this CPU cannot run the {level} kernels (it runs: {', '.join(runs)})")
    with isa.use(level):
        yield level


@pytest.fixture(params=isa.LEVELS)
def cpu_isa(request):
    """Each ISA level of the CPU kernels, active during the test. A level this CPU cannot run
    is skipped with the reason; one it can run must build (the Makefile installs a compiler)."""
    yield from _kernel_level(request.param)


@pytest.fixture(params=sorted(BF16_DOT_LEVELS))
def bf16_dot_isa(request):
    """The ISA levels with the bf16 dot-product path (the one that reads a paired KV cache),
    active during the test; skipped with the reason where the CPU cannot run them."""
    yield from _kernel_level(request.param)


@pytest.fixture(params=["gather", *isa.LEVELS])
def attention_backend(request):
    """Each attention backend: gathering blocks (what GPUs run), or the CPU kernel reading them
    in place at each ISA level (skipped where the CPU cannot run it)."""
    if request.param == "gather":
        yield GatherBackend()
    else:
        for _ in _kernel_level(request.param):
            yield CPUKernelBackend()


@pytest.fixture(scope="session")
def synth_llama(tmp_path_factory):
    return str(synth_model(tmp_path_factory.mktemp("llama"), SynthSpec(arch="llama")))


@pytest.fixture(scope="session")
def synth_llama_long(tmp_path_factory):
    """A tiny llama with room for a tutor prompt (the course material is a few thousand of its
    byte-level tokens)."""
    spec = SynthSpec(arch="llama", max_position_embeddings=8192, seed=2)
    return str(synth_model(tmp_path_factory.mktemp("llama-long"), spec))


@pytest.fixture(scope="session")
def synth_qwen2(tmp_path_factory):
    spec = SynthSpec(arch="qwen2", tie_word_embeddings=True, heads=4, kv_heads=1, seed=1)
    return str(synth_model(tmp_path_factory.mktemp("qwen2"), spec))


@pytest.fixture(scope="session")
def synth_qwen3(tmp_path_factory):
    """Qwen3: RMSNorms over each head of q and k (random weights, so they matter), no biases."""
    spec = SynthSpec(arch="qwen3", heads=4, kv_heads=2, seed=3)
    return str(synth_model(tmp_path_factory.mktemp("qwen3"), spec))


@pytest.fixture(scope="session")
def mixed_prompts():
    """16 prompts of mixed lengths; half share a 70-token prefix (over 4 KV blocks)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 470) for _ in range(70)]
    prompts = []
    for i in range(16):
        body = [rng.randrange(3, 470) for _ in range(rng.randrange(1, 120))]
        prompts.append(shared + body if i % 2 else body)
    return prompts


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


def _hf_greedy(model, prompts, max_new_tokens):
    """Reference: transformers forward with its own KV cache, greedy, one unpadded prompt at a
    time, never stopping at EOS (`generate`'s min_new_tokens would mask EOS instead)."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = model(torch.tensor([p]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            for _ in range(max_new_tokens - 1):
                out = model(
                    torch.tensor([[tokens[-1]]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
                tokens.append(int(out.logits[0, -1].argmax()))
            outs.append(tokens)
    return outs


@dataclass
class LiveServer:
    """A `tutorserve serve` subprocess on a free loopback port."""

    url: str
    model: str
    proc: subprocess.Popen

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics keyed like 'tutorserve:kv_cache_blocks{state=used}'."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, *args: str, env: dict[str, str] | None = None) -> LiveServer:
    """A server on `model`; its tutor store and disk tier live in fresh temporary folders
    unless `env` names them (a restart test does)."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "tutorserve.cli",
        "serve",
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--port",
        str(port),
        "--num-kv-blocks",
        "2048",
        "--dtype",
        "float32",
        *args,
    ]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (the server outlives this function)
    env = {
        "TUTORSERVE_KV_DIR": tempfile.mkdtemp(prefix="kv-"),
        "TUTORSERVE_DATA_DIR": tempfile.mkdtemp(prefix="tutor-"),
        **(env or {}),
    }
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    server = LiveServer(f"http://127.0.0.1:{port}", "tiny", proc)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read().decode()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("server did not become healthy within 120 s")


@pytest.fixture(scope="session")
def live_server(synth_llama):
    server = start_server(synth_llama)
    yield server
    server.stop()
