"""Prometheus metrics, named after vLLM's (`vllm:` → `tutorserve:`) so dashboards carry over.

Engine state (queues, KV blocks, prefix-cache counters) is an `EngineStats` snapshot taken at
scrape time by a collector, so the step loop pays nothing for it; per-request histograms are
observed when a request ends.
Each server owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from tutorserve.engine.outputs import RequestOutput
from tutorserve.engine.stats import EngineStats, TierSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "tutorserve:"
# Seconds; CPU serving is slow, so the buckets reach further than vLLM's GPU-minded ones.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)


# The engine snapshots to export, by their label values: one engine's under no labels, or each
# replica's under its id and role.
Snapshots = Callable[[], dict[tuple[str, ...], EngineStats]]
_M = TypeVar("_M", GaugeMetricFamily, CounterMetricFamily, SummaryMetricFamily)


class _EngineStateCollector(Collector):
    """Engine state as gauges and counters; every sample carries `labels` first (none for one
    engine, `replica` and `role` in a cluster, so a replica's counters restart with it without
    making the cluster's sum go backwards)."""

    def __init__(self, snapshots: Snapshots, labels: list[str]) -> None:
        self.snapshots, self.labels = snapshots, labels

    def _family(self, kind: Callable[..., _M], name: str, doc: str, *more: str) -> _M:
        return kind(PREFIX + name, doc, labels=[*self.labels, *more])

    def collect(self) -> Iterator[Metric]:
        snaps = self.snapshots()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        running = self._family(gauge, "num_requests_running", "Requests in the running batch.")
        waiting = self._family(
            gauge, "num_requests_waiting", "Accepted requests waiting to be scheduled."
        )
        blocks = self._family(
            gauge,
            "kv_cache_blocks",
            "KV cache blocks by state: used (held by a request), cached (free but keeping a "
            "prefix for reuse), empty.",
            "state",
        )
        usage = self._family(
            gauge, "kv_cache_usage_perc", "Fraction of KV cache blocks held by requests."
        )
        queries = self._family(
            counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        hits = self._family(
            counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        preempted = self._family(
            counter, "num_preemptions", "Requests preempted to free KV blocks."
        )
        steps = self._family(counter, "engine_steps", "Engine steps that computed tokens.")
        step_seconds = self._family(
            counter,
            "engine_step_seconds",
            "Wall time of those steps (schedule, forward, sampling, outputs).",
        )
        spec = {
            name: self._family(counter, "spec_decode_" + name, "Speculative decoding: " + doc)
            for name, doc in (
                ("num_drafts", "Decode rows that verified drafted tokens."),
                ("num_draft_tokens", "Tokens drafted."),
                ("num_accepted_tokens", "Drafted tokens accepted."),
            )
        }
        per_pos = self._family(
            counter,
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: drafts whose token at this position was accepted.",
            "position",
        )
        for key, s in snaps.items():
            k = list(key)
            running.add_metric(k, s.num_running)
            waiting.add_metric(k, s.num_waiting)
            blocks.add_metric([*k, "used"], s.kv_blocks_used)
            blocks.add_metric([*k, "cached"], s.kv_blocks_cached)
            blocks.add_metric([*k, "empty"], s.kv_blocks_empty)
            usage.add_metric(k, s.kv_blocks_used / s.kv_blocks)
            queries.add_metric(k, s.prefix_query_tokens)
            hits.add_metric(k, s.prefix_hit_tokens)
            preempted.add_metric(k, s.num_preemptions)
            steps.add_metric(k, s.num_steps)
            step_seconds.add_metric(k, s.step_seconds)
            for name, family in spec.items():
                family.add_metric(k, getattr(s.spec, name))
            for i, n in enumerate(s.spec.accepted_per_position):
                per_pos.add_metric([*k, str(i)], n)
        yield from (running, waiting, blocks, usage, queries, hits, preempted, steps,
                    step_seconds, *spec.values())  # fmt: skip
        yield per_pos
        tiers = {key: s.tiers for key, s in snaps.items() if s.tiers}
        if tiers:
            yield from self._tier_metrics(tiers)

    def _tier_metrics(
        self, tiers: dict[tuple[str, ...], tuple[TierSnapshot, ...]]
    ) -> Iterator[Metric]:
        """Per KV tier (ram, disk): lookups, traffic, restore latency and occupancy."""
        counters = {
            "hits": "KV blocks restored from the tier instead of recomputed.",
            "misses": "Requests whose cached prefix ran out in the tier.",
            "bytes_in": "Bytes written into the tier.",
            "bytes_out": "Bytes read out of the tier.",
            "errors": "Corrupt, truncated or foreign blocks dropped and recomputed.",
            "dropped_writes": "Blocks not stored: over budget or writer backlog.",
        }
        families = {
            name: self._family(CounterMetricFamily, f"kv_tier_{name}", doc, "tier")
            for name, doc in counters.items()
        }
        load = self._family(
            SummaryMetricFamily,
            "kv_tier_load_seconds",
            "Time to restore one request's run of blocks from the tier (disk: read into RAM).",
            "tier",
        )
        used = self._family(GaugeMetricFamily, "kv_tier_usage_bytes", "Bytes held.", "tier")
        cap = self._family(GaugeMetricFamily, "kv_tier_capacity_bytes", "Byte budget.", "tier")
        blocks = self._family(GaugeMetricFamily, "kv_tier_blocks", "Blocks held.", "tier")
        for key, snapshot in tiers.items():
            for t in snapshot:
                k = [*key, t.name]
                for name, family in families.items():
                    family.add_metric(k, getattr(t, name))
                load.add_metric(k, t.loads, t.load_seconds)
                used.add_metric(k, t.used_bytes)
                cap.add_metric(k, t.capacity_bytes)
                blocks.add_metric(k, t.blocks)
        yield from (*families.values(), load, used, cap, blocks)


class EngineMetrics:
    """`replica_stats`, where the server fronts a cluster: each replica's snapshot by its id and
    role (engine, or prefill / decode), exported under `replica` and `role` labels; otherwise
    `stats`, the one engine's, unlabelled."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        replica_stats: Snapshots | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        if replica_stats is None:
            collector = _EngineStateCollector(lambda: {(): stats()}, [])
        else:
            collector = _EngineStateCollector(replica_stats, ["replica", "role"])
        self.registry.register(collector)
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of ended requests.", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of ended requests.", registry=r
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Ended requests by finish reason (abort: the client left).",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            PREFIX + "request_rejected",
            "Requests refused with 429 by admission control.",
            ["reason"],
            registry=r,
        )

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.finished.labels(finished_reason=out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_output_tokens)
        if out.finish_reason == "abort":
            return  # a client leaving early says nothing about latency
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
