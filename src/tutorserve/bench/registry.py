"""Every system the benchmarks compare, one entry each: how `bench compare` starts it as a
server (`systems.py`), and how `bench offline` runs one repeat of the workload on it
(`offline.py`); a system has either or both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tutorserve.bench import offline
from tutorserve.bench.offline import SystemResult
from tutorserve.bench.systems import (
    ServeSpec,
    System,
    llama_server,
    transformers_server,
    tutorserve_server,
    vllm_replicas_server,
    vllm_server,
)
from tutorserve.bench.workloads import Request
from tutorserve.cluster.routing import POLICIES as ROUTING_POLICIES


@dataclass(slots=True)
class OfflineRun:
    """One repeat of `bench offline`, as every system gets it."""

    model: str
    hf_dir: str  # the HF export peers load
    timed: list[Request]
    warm: list[Request]  # served first, untimed, with other courses
    prime: list[Request]  # one earlier student per course, for runs with the courses warm
    engine_opts: dict[str, Any] = field(default_factory=dict)  # our engine's options
    max_num_seqs: int = 64
    hf_batch_size: int = 16
    dtype: str = "bfloat16"  # what every peer computes in


Result = tuple[str, SystemResult] | None  # (table label, result); None: not installed or failed


@dataclass(frozen=True, slots=True)
class Peer:
    name: str
    server: Callable[[str, ServeSpec], System] | None = None
    offline: Callable[[OfflineRun], Result] | None = None
    hf_export: bool = False  # loads the HF export of the model rather than its GGUF


def _ours(label: str, name: str, run: OfflineRun, primed: bool = False, **opts: Any) -> Result:
    prime = run.prime if primed else None
    return label, offline.run_tutorserve(
        name, run.model, run.timed, run.warm, prime, **run.engine_opts | opts
    )


def _vllm(run: OfflineRun, all_cores: bool) -> Result:
    res = offline.run_vllm(run.hf_dir, run.timed, run.max_num_seqs, all_cores,
                           extra_args=["--dtype", run.dtype])  # fmt: skip
    return None if res is None else (res.system, res)


def _transformers(run: OfflineRun) -> Result:
    res = offline.run_transformers(run.hf_dir, run.timed, run.warm, run.hf_batch_size, run.dtype)
    return res.system, res


PEERS = {
    p.name: p
    for p in (
        Peer("tutorserve", tutorserve_server,
             partial(_ours, "tutorserve (prefix cache)", "tutorserve")),
        Peer("tutorserve-notiers", partial(tutorserve_server, tiers=False)),
        Peer("tutorserve-gguf", partial(tutorserve_server, quantization="auto"),
             partial(_ours, "tutorserve (GGUF blocks)", "tutorserve-gguf",
                     quantization="auto")),
        Peer("tutorserve-dequantized", partial(tutorserve_server, quantization="none"),
             partial(_ours, "tutorserve (dequantized)", "tutorserve-dequantized",
                     quantization="none")),
        Peer("tutorserve-ngram", partial(tutorserve_server, speculative="ngram")),
        Peer("tutorserve-suffix", partial(tutorserve_server, speculative="suffix")),
        Peer("tutorserve-warm", None, partial(_ours, "tutorserve (prefix cache, courses warm)",
                                              "tutorserve-warm", primed=True)),
        Peer("tutorserve-nocache", None, partial(_ours, "tutorserve (no prefix cache)",
                                                 "tutorserve-nocache",
                                                 enable_prefix_caching=False)),
        *(Peer(f"tutorserve-x2-{r}", partial(tutorserve_server, tiers=False, replicas=2,
                                              routing=r))
          for r in ROUTING_POLICIES),
        # Session routing with the tiers on: a killed replica's sessions resume from the
        # shared disk folder (`--kill-replica-after`).
        Peer("tutorserve-x2-session-tiers", partial(tutorserve_server, replicas=2,
                                                    routing="session")),
        # Prefill/decode disaggregation; tiers on (the prompts' blocks move through disk).
        Peer("tutorserve-pd-1x1", partial(tutorserve_server, disagg=(1, 1))),
        Peer("vllm", vllm_server, partial(_vllm, all_cores=False), hf_export=True),
        Peer("vllm-ngram", partial(vllm_server, ngram=True), hf_export=True),
        Peer("vllm-allcores", partial(vllm_server, all_cores=True),
             partial(_vllm, all_cores=True), hf_export=True),
        # The peer of tutorserve-x2-round-robin: two vLLMs on one core each.
        Peer("vllm-x2-round-robin", vllm_replicas_server, hf_export=True),
        Peer("llama-server", llama_server),
        Peer("llama-server-bf16", partial(llama_server, bf16=True), hf_export=True),
        Peer("transformers", transformers_server, _transformers, hf_export=True),
        Peer("transformers-batch8", partial(transformers_server, batch=8), hf_export=True),
    )
}  # fmt: skip
SERVERS = tuple(n for n, p in PEERS.items() if p.server)  # what `bench compare` can start
OFFLINE = tuple(n for n, p in PEERS.items() if p.offline)  # what `bench offline` can run


def make_system(name: str, spec: ServeSpec) -> System:
    """The command line that serves `spec` as system `name`."""
    peer = PEERS.get(name)
    if peer is None or peer.server is None:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SERVERS)}")
    return peer.server(name, spec)
