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
from tutorserve.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerOutput:
    # One-token rows first (decode-shaped), then multi-token prefill chunks.
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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
        self.kv.free(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
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

    def _admit(self, picked: list[tuple[Sequence, int]], budget: int) -> int:
        bs = self.kv.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.match_prefix(seq)
            n = min(seq.num_tokens - len(hits) * bs, budget)
            if not self.kv.allocate(seq, n, hits):
                break
            self.waiting.pop(0)
            self.kv.record_prefix_lookup(seq.num_tokens, len(hits) * bs)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = len(hits) * bs
            seq.num_computed_tokens = len(hits) * bs
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=Sequence.sort_key)
            picked.append((seq, n))
            budget -= n
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
        log.debug("preempted %s (%d tokens) for recompute", seq.request_id, seq.num_tokens)
