"""How `bench compare` starts each server (one at a time on 127.0.0.1, each on the same model;
`registry.py` lists them) and waits for it.

Ours serves the GGUF directly; vLLM and transformers load a HF export of it; llama.cpp's
`llama-server` serves the GGUF file itself (Q4_1, so it computes on 4-bit weights) and a bf16 GGUF
converted from the HF export, for a like-for-like row. Peers live in their own venvs or build
folders under the cache directory, installed by the scripts in `peers/` beside this file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from tutorserve.bench.offline import PEERS_DIR, cache_dir, vllm_all_cores_env, vllm_python
from tutorserve.engine.device import resolve_dtype
from tutorserve.models.loader import load_model_config

log = logging.getLogger(__name__)
_VLLM_CPU_BLOCK = 128  # vLLM-CPU's default KV block, in tokens
_VLLM_MAX_MODEL_LEN = 8192


@dataclass(slots=True)
class System:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    missing: str | None = None  # why it cannot run here (and how to install it)
    startup_timeout_s: float = 300.0


@dataclass(slots=True)
class ModelFiles:
    name: str  # the id every server is told to answer to
    gguf: str  # the registered GGUF (our default model ships as Q4_1)
    hf_dir: str  # HF export of the same weights (vLLM, transformers, the bf16 GGUF)


def llama_server_bin() -> Path:
    return cache_dir() / "peers" / "llama.cpp" / "bin" / "llama-server"


def bf16_gguf(model: str) -> Path:
    return cache_dir() / "peers" / "llama.cpp" / f"{model.replace('/', '_')}-bf16.gguf"


@dataclass(frozen=True, slots=True)
class ServeSpec:
    """What every server of a comparison is told: the model, where to listen, its batch limit
    and KV pool (vLLM-CPU takes whole GiB, so it gets at least 1), and the dtype every peer
    computes in (auto: `host_dtype`; ours is told it as is, so that under auto it also picks
    its KV storage)."""

    files: ModelFiles
    port: int
    max_num_seqs: int
    kv_cache_gb: float = 1.0
    dtype: str = "auto"
    step_log_dir: str | None = None  # ours only: its engines' step logs (engine/step_log.py)

    @property
    def listen(self) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(self.port)]


def tutorserve_server(
    name: str,
    s: ServeSpec,
    tiers: bool = True,
    quantization: str | None = None,  # None: the engine's default
    speculative: str | None = None,
    replicas: int = 0,
    routing: str = "cache-aware",
    disagg: tuple[int, int] | None = None,  # (prefill, decode) replicas
) -> System:
    # A fresh disk tier per run: one left by an earlier run would flatter this one.
    extra = ["--kv-disk-dir", tempfile.mkdtemp(prefix="bench-kv-")]
    if not tiers:
        extra = ["--kv-ram-gb", "0", "--kv-disk-gb", "0"]
    if speculative is not None:
        extra += ["--speculative", speculative]
    if quantization is not None:
        extra += ["--quantization", quantization]
    if replicas:  # engines on Ray Serve, one thread each by default
        extra += ["--replicas", str(replicas), "--routing", routing]
    if s.step_log_dir is not None:
        extra += ["--step-log-dir", s.step_log_dir]
    if disagg is not None:  # needs the disk tier: its blocks move through it
        extra += ["--prefill-replicas", str(disagg[0]), "--decode-replicas", str(disagg[1]),
                  "--routing", routing]  # fmt: skip
    argv = [sys.executable, "-m", "tutorserve.cli", "serve", "--model", s.files.gguf,
            "--served-model-name", s.files.name, "--dtype", s.dtype, "--max-num-seqs",
            str(s.max_num_seqs), "--kv-cache-gb", f"{s.kv_cache_gb:g}", *extra, "--max-waiting",
            "100000", *s.listen]  # fmt: skip
    return System(name, argv)


def vllm_server(name: str, s: ServeSpec, all_cores: bool = False, ngram: bool = False) -> System:
    env = {"VLLM_CPU_KVCACHE_SPACE": _vllm_kv_space(s.kv_cache_gb)}
    if all_cores:
        env |= vllm_all_cores_env()
    # Prompt lookup as our `--speculative ngram` does it: 4 tokens drafted from the longest
    # earlier match of the last 4 down to 2 tokens.
    spec = ["--speculative-config", json.dumps({
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2})] if ngram else []  # fmt: skip
    return System(name, [*_vllm_command(s), *spec, *s.listen], env, _vllm_missing())


def vllm_replicas_server(name: str, s: ServeSpec, replicas: int = 2) -> System:
    """`replicas` vLLM-CPU servers, one core each, behind `peers/round_robin.py` on `s.port`:
    the peer of our `--replicas N --routing round-robin`, whose every replica has a pool of
    `kv_cache_gb`. vLLM's pool is given in whole GiB, so it is capped by a block count instead
    (`--num-gpu-blocks-override`, of its CPU default 128-token blocks): the same tokens each."""
    blocks = int(s.kv_cache_gb * (1 << 30)) // (_kv_bytes_per_token(s) * _VLLM_CPU_BLOCK)
    # vLLM refuses to start unless its pool holds one request of its longest length, and it
    # keeps one block back (measured: 54 blocks allow 6,784 tokens).
    longest = min(_VLLM_MAX_MODEL_LEN, (blocks - 1) * _VLLM_CPU_BLOCK)
    upstream = [*_vllm_command(s, longest), "--block-size", str(_VLLM_CPU_BLOCK),
                "--num-gpu-blocks-override", str(blocks), "--host", "127.0.0.1",
                "--port", "{port}"]  # fmt: skip
    argv = [sys.executable, str(PEERS_DIR / "round_robin.py"), *s.listen, "--replicas",
            str(replicas), "--replica-env", "VLLM_CPU_OMP_THREADS_BIND={i}", "--replica-env",
            "VLLM_CPU_NUM_OF_RESERVED_CPU=0", "--", *upstream]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": _vllm_kv_space(s.kv_cache_gb)}
    # Each vLLM compiles its model at start-up, the copies side by side on one core each.
    return System(name, argv, env, _vllm_missing(), startup_timeout_s=600.0)


def _kv_bytes_per_token(s: ServeSpec) -> int:
    cfg = load_model_config(s.files.hf_dir)
    return cfg.kv_bytes_per_token(4 if host_dtype(s.dtype) == "float32" else 2)


def _vllm_command(s: ServeSpec, max_model_len: int = _VLLM_MAX_MODEL_LEN) -> list[str]:
    """vLLM's OpenAI server for `s`, less where it listens."""
    return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model",
            s.files.hf_dir, "--served-model-name", s.files.name, "--dtype", host_dtype(s.dtype),
            "--max-model-len", str(max_model_len), "--enable-prefix-caching", "--max-num-seqs",
            str(s.max_num_seqs)]  # fmt: skip


def _vllm_kv_space(gb: float) -> str:
    return str(max(1, math.ceil(gb)))  # VLLM_CPU_KVCACHE_SPACE takes whole GiB


def _vllm_missing() -> str | None:
    return None if vllm_python().exists() else f"run {PEERS_DIR / 'install_vllm_cpu.sh'}"


def llama_server(name: str, s: ServeSpec, bf16: bool = False) -> System:
    """llama.cpp's server on the registered GGUF (Q4_1), or on a bf16 GGUF of the HF export."""
    binary = llama_server_bin()
    gguf = str(bf16_gguf(s.files.name)) if bf16 else s.files.gguf
    # The context is split evenly across slots: 8k tokens each. One compute thread: with two,
    # its spinning OpenMP threads collapse (TTFT 55 s at 0.25 req/s) as soon as the load
    # client needs the CPU too; vLLM-CPU likewise keeps a core free by default.
    argv = [str(binary), "-m", gguf, "-a", s.files.name, "-t", "1", "-c",
            str(8192 * s.max_num_seqs), "-np", str(s.max_num_seqs), "--no-webui", "--metrics",
            *s.listen]  # fmt: skip
    missing = None
    if not binary.exists():
        missing = f"run {PEERS_DIR / 'install_llama_server.sh'}"
    elif not Path(gguf).exists():
        missing = f"make {gguf} with {PEERS_DIR / 'llama_bf16_gguf.sh'}"
    return System(name, argv, missing=missing)


def transformers_server(name: str, s: ServeSpec, batch: int = 1) -> System:
    argv = [sys.executable, str(PEERS_DIR / "transformers_server.py"), "--model",
            s.files.hf_dir, "--served-model-name", s.files.name, "--dtype",
            host_dtype(s.dtype), "--batch-size", str(batch), *s.listen]  # fmt: skip
    return System(name, argv)


def host_dtype(name: str) -> str:
    """`name`, or for auto the dtype our engine computes in on this host: bf16 where the CPU has
    native bf16, else float32 (bf16 is emulated there and slower for every system)."""
    if name != "auto":
        return name
    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


class RunningServer:
    """Start a system's server, wait until `/v1/models` answers, and stop it (whole process
    group: vLLM forks its engine core) on exit."""

    def __init__(self, system: System, port: int, log_path: Path) -> None:
        self.system = system
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RunningServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                self.system.argv, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **self.system.env}, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + self.system.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.system.name} exited at start-up:\n{tail}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    log.info("%s is up at %s", self.system.name, self.url)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"{self.system.name} not ready after {self.system.startup_timeout_s} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return
