"""A snapshot of the engine's state, as vLLM's stat loggers read it: everything a metrics
exporter or a dashboard shows, copied out of the engine in one call, so that they read no
engine internals."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """One KV tier (ram or disk): lookups, traffic, restore time and occupancy."""

    name: str
    hits: int  # blocks restored instead of recomputed
    misses: int  # admitted requests whose cacheable prompt the tier did not hold to the end
    bytes_in: int
    bytes_out: int
    errors: int  # corrupt, truncated or foreign blocks dropped (and recomputed)
    dropped_writes: int  # writes skipped: over budget, or the writer behind
    loads: int  # restores of one request's run of blocks
    load_seconds: float
    used_bytes: int
    capacity_bytes: int
    blocks: int


@dataclass(slots=True)
class SpecCounters:
    """Speculative decoding so far: decode rows that verified drafts, tokens drafted, and
    drafted tokens the model accepted (vLLM's spec_decode counters)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    # accepted_per_position[i]: drafts whose token i was accepted (so tokens 0..i were)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_per_position)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position += [0] * (accepted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def copy(self) -> SpecCounters:
        return SpecCounters(
            self.num_drafts, self.num_draft_tokens, list(self.accepted_per_position)
        )


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int  # requests in the running batch
    num_waiting: int  # accepted, not yet scheduled
    kv_blocks: int  # the pool's size
    kv_blocks_used: int  # held by requests
    kv_blocks_free: int  # held by none
    kv_blocks_cached: int  # free, but keeping a prefix for reuse
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # ... and found there
    num_preemptions: int
    tiers: tuple[TierSnapshot, ...]  # empty without KV tiers
    spec: SpecCounters = field(default_factory=SpecCounters)  # a copy
    # Steps that computed something, and their wall time (schedule, forward, sampling, outputs):
    # the engine's own time per step under serving, beside what a step costs alone.
    num_steps: int = 0
    step_seconds: float = 0.0

    @property
    def kv_blocks_empty(self) -> int:
        return self.kv_blocks_free - self.kv_blocks_cached

    @staticmethod
    def sum(snapshots: list[EngineStats]) -> EngineStats:
        """Several engines' snapshot (a cluster's): every counter summed, tiers summed by name."""
        if not snapshots:
            return EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, ())
        numbers = {f.name: sum(getattr(s, f.name) for s in snapshots)
                   for f in fields(EngineStats) if f.name not in ("tiers", "spec")}  # fmt: skip
        tiers: dict[str, TierSnapshot] = {}
        for s in snapshots:
            for t in s.tiers:
                prev = tiers.get(t.name)
                tiers[t.name] = t if prev is None else TierSnapshot(t.name, *(
                    getattr(prev, f.name) + getattr(t, f.name) for f in fields(TierSnapshot)[1:]
                ))  # fmt: skip
        spec = SpecCounters()
        for s in snapshots:
            spec.num_drafts += s.spec.num_drafts
            spec.num_draft_tokens += s.spec.num_draft_tokens
            for i, k in enumerate(s.spec.accepted_per_position):
                if i == len(spec.accepted_per_position):
                    spec.accepted_per_position.append(0)
                spec.accepted_per_position[i] += k
        return EngineStats(**numbers, tiers=tuple(tiers.values()), spec=spec)
