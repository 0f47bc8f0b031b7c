"""A simulated deployment: the step-cost model, the model's KV size and the replicas' settings,
built from flags or read back from a measured benchmark run's own command line."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from tutorserve.bench.step_cost import StepCostModel
from tutorserve.cluster.routing import policy_named
from tutorserve.models.config import ModelConfig
from tutorserve.sim.replica import ReplicaSpec, SimReplica
from tutorserve.sim.simulator import Simulation

GIB = 1 << 30


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """As the engine stores KV: the model's dtype, bf16 for auto (`engine/device.py`)."""
    return cfg.kv_bytes_per_token(4 if dtype == "float32" else 2)


@dataclass(frozen=True, slots=True)
class Deployment:
    replicas: int
    routing: str
    spec: ReplicaSpec
    # Prefill/decode split: this many of the replicas only prefill, the rest decode, and KV
    # moves between them at `transfer_s_per_token` (0 replicas: every replica does both).
    prefill: int = 0
    transfer_s_per_token: float = 0.0

    @classmethod
    def of(
        cls,
        cfg: ModelConfig,
        dtype: str,
        kv_cache_gb: float,
        replicas: int = 1,
        routing: str = "cache-aware",
        ram_tier_gb: float = 0.0,
        link_gbs: float = 0.0,
        **spec: Any,
    ) -> Deployment:
        """`link_gbs`: how fast KV moves from a prefill to a decode replica (P/D splits)."""
        block = kv_bytes_per_token(cfg, dtype) * spec.get("block_size", 16)
        blocks = int(kv_cache_gb * GIB) // block
        if blocks < 1 or replicas < 1:
            raise ValueError("need --replicas >= 1 and a KV budget of at least one block")
        policy_named(routing)  # a wrong name fails here, before any simulation
        ram = int(ram_tier_gb * GIB) // block
        transfer = kv_bytes_per_token(cfg, dtype) / (link_gbs * 1e9) if link_gbs else 0.0
        spec_ = ReplicaSpec(num_kv_blocks=blocks, ram_tier_blocks=ram, **spec)
        return cls(replicas, routing, spec_, transfer_s_per_token=transfer)

    @classmethod
    def from_argv(cls, argv: list[str], cfg: ModelConfig) -> Deployment:
        """The deployment a benchmark's server ran as (`bench compare` keeps its argv)."""

        def flag(name: str, default: str) -> str:
            return argv[argv.index(name) + 1] if name in argv else default

        if float(flag("--kv-disk-gb", "4")) > 0:
            raise ValueError(
                "that run kept a disk KV tier; the simulator models the RAM tier only "
                "(compare runs with --kv-disk-gb 0, e.g. tutorserve-notiers)"
            )
        return cls.of(
            cfg,
            flag("--dtype", "auto"),
            float(flag("--kv-cache-gb", "1")),
            int(flag("--replicas", "1")),
            flag("--routing", "cache-aware"),
            float(flag("--kv-ram-gb", "2")),
            max_num_seqs=int(flag("--max-num-seqs", "64")),
            max_num_batched_tokens=int(flag("--max-num-batched-tokens", "2048")),
            enable_prefix_caching="--no-prefix-caching" not in argv,
        )

    def with_options(
        self, routing: str, prefix_caching: bool, ram_tier: bool, prefill: int = 0
    ) -> Deployment:
        """The same replicas under another routing, with or without the prefix cache and the
        RAM tier, split into `prefill` prefill replicas and the rest decode ones (0: no split)."""
        if prefill and not 0 < prefill < self.replicas:
            raise ValueError("a prefill/decode split needs replicas of both kinds")
        spec = replace(self.spec, enable_prefix_caching=prefix_caching,
                       ram_tier_blocks=self.spec.ram_tier_blocks if ram_tier else 0)  # fmt: skip
        return replace(self, routing=routing, spec=spec, prefill=prefill)

    def simulation(self, cost: StepCostModel, vocab: int) -> Simulation:
        if not self.prefill:
            replicas = [SimReplica(f"replica-{i}", self.spec, cost, vocab)
                        for i in range(self.replicas)]  # fmt: skip
            return Simulation(replicas, policy_named(self.routing))
        # Decode replicas stage received KV in a tier at least as large as their pool.
        staging = replace(
            self.spec,
            enable_prefix_caching=True,
            ram_tier_blocks=max(self.spec.ram_tier_blocks, self.spec.num_kv_blocks),
        )
        prefill = [SimReplica(f"prefill-{i}", self.spec, cost, vocab) for i in range(self.prefill)]
        decode = [SimReplica(f"decode-{i}", staging, cost, vocab)
                  for i in range(self.replicas - self.prefill)]  # fmt: skip
        return Simulation(prefill, policy_named(self.routing), decode, self.transfer_s_per_token)

    def label(self) -> str:
        caching = "" if self.spec.enable_prefix_caching else ", no prefix cache"
        tier = f", RAM tier {self.spec.ram_tier_blocks} blocks" if self.spec.ram_tier_blocks else ""
        split = (
            f", {self.prefill} prefill + {self.replicas - self.prefill} decode"
            if self.prefill
            else ""
        )
        return f"{self.replicas}× replica, {self.routing}{caching}{tier}{split}"


def relative_error(predicted: float, measured: float) -> float:
    return math.nan if not measured else (predicted - measured) / measured
