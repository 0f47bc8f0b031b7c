"""One engine replica in virtual time: our own scheduler and KV cache manager, unchanged, with
the model forward replaced by the step-cost model's prediction.

Running the engine's real `Scheduler` (token budget, chunked prefill, cache-aware admission,
preemption by recompute) and `KVCacheManager` (block pool, chained-hash prefix cache, LRU
eviction) is what keeps the simulator faithful at block granularity: there is no second copy of
those policies to drift from the engine. What is left out is what the cost model stands for:
the tokens' values. Outputs are stand-in ids, as many as the request asks (the benchmarks send
`ignore_eos`), so a session's next prompt extends this one with them, as a real chat does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tutorserve.bench.step_cost import StepCostModel
from tutorserve.config import EngineConfig
from tutorserve.engine.kv_cache_manager import KVCacheManager
from tutorserve.engine.scheduler import Scheduler
from tutorserve.engine.sequence import Sequence
from tutorserve.paging import extend_block_hashes
from tutorserve.sampling_params import SamplingParams
from tutorserve.sim.tiers import SimRamTier


@dataclass(slots=True)
class SimRequest:
    """A turn as the simulator tracks it, from arrival to its last token."""

    request_id: str
    session: int
    turn: int
    prompt: list[int]
    max_tokens: int
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    output: list[int] | None = None  # stand-in output ids, for the session's next prompt
    block_hashes: list[bytes] = field(default_factory=list)  # its prompt's, hashed once to route
    key: str = ""  # its session's, at the router and in the tiers (unique across runs)


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What an engine replica is given: its KV pool and batch limits (`EngineConfig`'s)."""

    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    scheduling: str = "cache-aware"
    ram_tier_blocks: int = 0  # the host-RAM KV tier below the pool (0: none)
    session_ttl: float = 3600.0

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduling=self.scheduling,
            kv_ram_bytes=0,
        )


class SimReplica:
    def __init__(self, name: str, spec: ReplicaSpec, cost: StepCostModel, vocab: int) -> None:
        self.name = name
        self.spec = spec
        self.cost = cost
        self.vocab = vocab
        self.clock = [0.0]
        self.tier = None
        if spec.ram_tier_blocks and spec.enable_prefix_caching:
            if cost.restore_s_per_block is None:
                raise ValueError("the step-cost model has no restore cost (rerun calibrate)")
            self.tier = SimRamTier(spec.ram_tier_blocks, cost.restore_s_per_block,
                                   spec.session_ttl, self.clock)  # fmt: skip
        self.kv = KVCacheManager(spec.num_kv_blocks, spec.block_size, spec.enable_prefix_caching,
                                 self.tier)  # type: ignore[arg-type]  # fmt: skip
        self.scheduler = Scheduler(spec.engine_config(), self.kv)
        self.busy = False  # a step is in flight
        self.requests: dict[str, tuple[SimRequest, Sequence]] = {}
        self.busy_seconds = 0.0
        self.num_steps = 0
        self.peak_used_blocks = 0
        self.block_seconds = 0.0  # ∫ used KV blocks dt, for mean occupancy
        self._counted_from = (0, 0, 0)  # the engine's own counters when counting began
        self._batch: list[tuple[Sequence, int]] = []
        self._rng = random.Random(name)  # stand-in output ids (events run in a fixed order)

    @property
    def load(self) -> int:
        return len(self.requests)

    def start_counting(self) -> None:
        """Count steps, occupancy, prefix hits and preemptions from here on (what it served
        before keeps its cache contents, not its share of the counts)."""
        self.busy_seconds = self.block_seconds = 0.0
        self.num_steps = self.peak_used_blocks = 0
        self._counted_from = (self.kv.prefix_query_tokens, self.kv.prefix_hit_tokens,
                              self.scheduler.num_preemptions)  # fmt: skip

    @property
    def prefix_query_tokens(self) -> int:
        return self.kv.prefix_query_tokens - self._counted_from[0]

    @property
    def prefix_hit_tokens(self) -> int:
        return self.kv.prefix_hit_tokens - self._counted_from[1]

    @property
    def preemptions(self) -> int:
        return self.scheduler.num_preemptions - self._counted_from[2]

    def add(self, req: SimRequest, prompt: list[int] | None = None,
            max_tokens: int | None = None) -> None:  # fmt: skip
        """Queue `req`; a prefill or decode replica of a P/D split runs a part of it: its prompt
        up to the first token, or the rest from there (`prompt` and `max_tokens` given)."""
        prompt = req.prompt if prompt is None else prompt
        max_tokens = req.max_tokens if max_tokens is None else max_tokens
        if len(prompt) + max_tokens > self.spec.num_kv_blocks * self.spec.block_size:
            raise ValueError(f"request {req.request_id} alone outgrows the replica's KV pool")
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        seq = Sequence(req.request_id, prompt, params, arrival_time=req.arrival,
                       session_id=req.key)  # fmt: skip
        if prompt is req.prompt:  # the engine would hash them again on admission
            seq.block_hashes = list(req.block_hashes)
        self.requests[req.request_id] = (req, seq)
        self.scheduler.add(seq)

    def receive_kv(self, tokens: list[int]) -> None:
        """A prefill replica's KV of `tokens` arrived (P/D): its full blocks wait in this
        replica's staging tier until the request is admitted and copies them into the pool."""
        if self.tier is None:
            raise ValueError("a decode replica needs a staging tier for the KV it receives")
        hashes = extend_block_hashes([], tokens, self.spec.block_size)
        self.tier.keep_session([(-1, h) for h in hashes])

    def start_step(self, now: float, sibling_busy: bool = False) -> float | None:
        """Schedule a step at `now`, another replica stepping or not; its predicted duration
        (None: nothing to run)."""
        self.clock[0] = now
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return None
        self._batch = list(zip(batch.seqs, batch.num_tokens, strict=True))
        self.busy = True
        seconds = self.cost.step_seconds(batch.shape(), sibling_busy)
        if self.tier is not None:
            seconds += self.tier.take_restored()
        used = self.kv.num_used_blocks
        self.busy_seconds += seconds
        self.block_seconds += used * seconds
        self.num_steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, used)
        return seconds

    def finish_step(self, now: float) -> list[SimRequest]:
        """Apply the step that ends at `now` (as `LLMEngine.step` does after the forward); the
        requests it finished."""
        self.busy = False
        done = []
        for seq, n in self._batch:
            seq.num_computed_tokens += n
            self.kv.cache_computed_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            req = self.requests[seq.request_id][0]
            if req.first_token is None:
                req.first_token = now
                req.num_cached_tokens = max(seq.num_cached_tokens, 0)
            seq.token_ids.append(self._rng.randrange(self.vocab))
            if seq.num_output_tokens >= seq.params.max_tokens:
                req.finish = now
                req.num_preemptions += seq.num_preemptions
                req.output = (req.output or []) + seq.output_token_ids
                self.scheduler.remove(seq)
                del self.requests[seq.request_id]
                done.append(req)
        self._batch = []
        return done
