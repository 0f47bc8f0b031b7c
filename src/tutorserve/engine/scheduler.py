"""Continuous batching under one token budget per step, with chunked prefill and preemption.

Each step first serves running requests (decodes cost one token, unfinished prefills continue in
chunks), then admits waiting ones while budget, sequence slots and KV blocks last. When a running
request cannot get a block, the lowest-priority running request is preempted by recompute: its
blocks are released (full ones stay in the prefix cache, so recompute is often a cache hit) and it
goes back to the waiting queue at its original place, ahead of later arrivals, so it cannot starve.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from tutorserve.config import EngineConfig
from tutorserve.engine.kv_cache_manager import KVCacheManager
from tutorserve.engine.policy import policy_named
from tutorserve.engine.sequence import Sequence, SequenceStatus
from tutorserve.lora.manager import LoRAManager

log = logging.getLogger(__name__)
_LPM_WINDOW = 64  # waiting requests ordered per admission; bounds the cost under overload


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, as a step-cost model sees it (`bench/step_cost.py`)."""

    rows: tuple[tuple[int, int], ...]  # per request: (tokens computed now, tokens in KV before)
    num_adapters: int = 0  # distinct LoRA adapters in the batch
    lora_tokens: int = 0  # tokens of rows that run an adapter


@dataclass(slots=True)
class SchedulerOutput:
    # One-token rows first (decode-shaped), then multi-token ones: prefill chunks, and decode
    # rows verifying drafts (their token count includes the drafts).
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def shape(self) -> StepShape:
        """Taken before the step runs (its rows' KV lengths are those before it)."""
        lora = [(s.lora, n) for s, n in zip(self.seqs, self.num_tokens, strict=True) if s.lora]
        return StepShape(
            tuple((n, s.num_computed_tokens) for s, n in zip(self.seqs, self.num_tokens,
                                                              strict=True)),
            len({a for a, _ in lora}),
            sum(n for _, n in lora),
        )  # fmt: skip


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv: KVCacheManager, lora: LoRAManager | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.lora = lora
        self.policy = policy_named(config.scheduling)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.failed: list[Sequence] = []  # taken out of the queue for the engine to end

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.cache_computed_blocks(seq)
        self.kv.keep_session(seq)
        self.kv.free(seq)
        self._release_lora(seq)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0 and self.lora is not None:
            self.lora.release(seq.lora_slot)
        seq.lora_slot = -1

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens + len(seq.spec_token_ids), budget)
            if seq.spec_token_ids and not self.kv.allocate(seq, n):
                n = 1  # drafts are dropped before anyone is preempted for their blocks
            del seq.spec_token_ids[max(0, n - 1) :]
            while not self.kv.allocate(seq, n):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                picked.append((seq, n))
                budget -= n
                i += 1
                continue
            break
        if not preempted:
            budget = self._admit(picked, budget)
        picked.sort(key=lambda p: p[1] > 1)
        return SchedulerOutput(
            seqs=[s for s, _ in picked], num_tokens=[n for _, n in picked], preempted=preempted
        )

    def _candidates(self) -> list[tuple[Sequence, list[int] | None]]:
        """The first waiting requests in the policy's admission order (`policy.py`), with their
        prefix-cache hits where the order needed them (None: look them up on admission)."""
        return self.policy.order(self.waiting[:_LPM_WINDOW], self.kv, self.config.max_bypass)

    def _admit(self, picked: list[tuple[Sequence, int]], budget: int) -> int:
        bs = self.kv.block_size
        # Hits cannot change within a step (blocks are published after they are computed), so
        # one ranking serves the step unless someone reaches the bypass limit meanwhile.
        ranked = self._candidates() if self.waiting else []
        inflight = self._inflight_blocks() if ranked else set()
        deferred: set[int] = set()  # ids of requests waiting on a prefix being computed
        i = 0
        while i < len(ranked) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq, hits = ranked[i]
            if hits is None:
                hits = self.kv.match_prefix(seq)
            if seq.num_bypassed < self.config.max_bypass and self._wait_for_prefix(
                seq, hits, inflight
            ):
                deferred.add(id(seq))
                i += 1
                continue
            tier = self.kv.match_tiers(seq, len(hits))
            if tier.pending:  # its history is being read from disk; others go on meanwhile
                deferred.add(id(seq))
                i += 1
                continue
            if not self._take_lora_slot(seq):
                if seq in self.failed:
                    i += 1
                    continue
                # Every slot serves running requests of other adapters. Skip it (it is charged a
                # bypass as others go ahead) until it has been passed over `max_bypass` times;
                # then admit nobody else, so slots drain and it goes next (vLLM's max-loras
                # admission can starve it).
                if not self.policy.passes_over or seq.num_bypassed >= self.config.max_bypass:
                    break
                i += 1
                continue
            cached = (len(hits) + len(tier.keys)) * bs
            n = min(seq.num_tokens - cached, budget)
            if not self.kv.allocate(seq, n + len(tier.keys) * bs, hits):
                self._release_lora(seq)
                break
            self.waiting.remove(seq)
            self.kv.restore(seq, len(hits), tier)
            self.kv.record_prefix_lookup(seq.num_tokens, cached)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            self.kv.cache_computed_blocks(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=Sequence.sort_key)
            picked.append((seq, n))
            budget -= n
            inflight.update(seq.block_hashes[cached // bs :])
            if self._count_bypass(seq, deferred):
                ranked, i = self._candidates(), 0
            else:
                i += 1
        return budget

    def _take_lora_slot(self, seq: Sequence) -> bool:
        if seq.lora is None or self.lora is None:
            return True
        try:
            slot = self.lora.acquire(seq.lora)
        except (ValueError, OSError) as e:  # its files changed on disk since it was loaded
            log.error("request %s: cannot page in LoRA adapter %s: %s", seq.request_id,
                      seq.lora, e)  # fmt: skip
            self.failed.append(seq)
            self.waiting.remove(seq)
            return False
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _inflight_blocks(self) -> set[bytes]:
        """Hashes of prompt blocks that running requests are still prefilling (their prompts
        were hashed when they were matched against the cache on admission)."""
        if not self.policy.passes_over or not self.kv.enable_prefix_caching:
            return set()
        bs, out = self.kv.block_size, set()
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens > 1:
                out.update(seq.block_hashes[seq.num_computed_tokens // bs :])
        return out

    @staticmethod
    def _wait_for_prefix(seq: Sequence, hits: list[int], inflight: set[bytes]) -> bool:
        """True when the next block this request would compute is being computed right now by
        another request (a student of a course whose prompt is mid-prefill): waiting a step or
        two turns that prefill into a cache hit instead of computing the prompt twice."""
        nxt = len(hits)
        return nxt < len(seq.block_hashes) and seq.block_hashes[nxt] in inflight

    def _count_bypass(self, admitted: Sequence, deferred: set[int]) -> bool:
        """Charge every earlier arrival still waiting, except those deferred for their own
        prefix's sake; True if one just reached the limit."""
        if not self.policy.passes_over:
            return False
        key, limit, aged = admitted.sort_key(), self.config.max_bypass, False
        for seq in self.waiting:
            if seq.sort_key() >= key:
                break
            if id(seq) in deferred:
                continue
            seq.num_bypassed += 1
            aged |= seq.num_bypassed == limit
        return aged

    def _preempt(self, seq: Sequence) -> None:
        seq.spec_token_ids.clear()
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        self._release_lora(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
        log.debug("preempted %s (%d tokens) for recompute", seq.request_id, seq.num_tokens)
