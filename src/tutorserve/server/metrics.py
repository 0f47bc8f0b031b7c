"""Prometheus metrics, named after vLLM's (`vllm:` → `tutorserve:`) so dashboards carry over.

Engine state (queues, KV blocks, prefix-cache counters) is an `EngineStats` snapshot taken at
scrape time by a collector, so the step loop pays nothing for it; per-request histograms are
observed when a request ends.
Each server owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

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
from tutorserve.tutor.service import TutorService

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_P = "tutorserve:"
# Seconds; CPU serving is slow, so the buckets reach further than vLLM's GPU-minded ones.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)


class _EngineStateCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield GaugeMetricFamily(
            _P + "num_requests_running", "Requests in the running batch.", value=s.num_running
        )
        yield GaugeMetricFamily(
            _P + "num_requests_waiting",
            "Accepted requests waiting to be scheduled.",
            value=s.num_waiting,
        )
        blocks = GaugeMetricFamily(
            _P + "kv_cache_blocks",
            "KV cache blocks by state: used (held by a request), cached (free but keeping a "
            "prefix for reuse), empty.",
            labels=["state"],
        )
        blocks.add_metric(["used"], s.kv_blocks_used)
        blocks.add_metric(["cached"], s.kv_blocks_cached)
        blocks.add_metric(["empty"], s.kv_blocks_empty)
        yield blocks
        yield GaugeMetricFamily(
            _P + "kv_cache_usage_perc",
            "Fraction of KV cache blocks held by requests.",
            value=s.kv_blocks_used / s.kv_blocks,
        )
        yield CounterMetricFamily(
            _P + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=s.prefix_query_tokens,
        )
        yield CounterMetricFamily(
            _P + "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            value=s.prefix_hit_tokens,
        )
        yield CounterMetricFamily(
            _P + "num_preemptions",
            "Requests preempted to free KV blocks.",
            value=s.num_preemptions,
        )
        for name, doc, value in (
            ("num_drafts", "Decode rows that verified drafted tokens.", s.spec.num_drafts),
            ("num_draft_tokens", "Tokens drafted.", s.spec.num_draft_tokens),
            ("num_accepted_tokens", "Drafted tokens accepted.", s.spec.num_accepted_tokens),
        ):
            yield CounterMetricFamily(_P + "spec_decode_" + name, "Speculative decoding: " + doc,
                                      value=value)  # fmt: skip
        per_pos = CounterMetricFamily(
            _P + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: drafts whose token at this position was accepted.",
            labels=["position"],
        )
        for i, n in enumerate(s.spec.accepted_per_position):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        if s.tiers:
            yield from _tier_metrics(s.tiers)


def _tier_metrics(tiers: tuple[TierSnapshot, ...]) -> Iterator[Metric]:
    """Per KV tier (ram, disk): lookups, traffic, restore latency and occupancy."""
    counters = {
        "hits": ("KV blocks restored from the tier instead of recomputed.", "hits"),
        "misses": ("Requests whose cached prefix ran out in the tier.", "misses"),
        "bytes_in": ("Bytes written into the tier.", "bytes_in"),
        "bytes_out": ("Bytes read out of the tier.", "bytes_out"),
        "errors": ("Corrupt, truncated or foreign blocks dropped and recomputed.", "errors"),
        "dropped_writes": ("Blocks not stored: over budget or writer backlog.", "dropped_writes"),
    }
    for name, (doc, attr) in counters.items():
        family = CounterMetricFamily(_P + f"kv_tier_{name}", doc, labels=["tier"])
        for t in tiers:
            family.add_metric([t.name], getattr(t, attr))
        yield family
    load = SummaryMetricFamily(
        _P + "kv_tier_load_seconds",
        "Time to restore one request's run of blocks from the tier (disk: read into RAM).",
        labels=["tier"],
    )
    used = GaugeMetricFamily(_P + "kv_tier_usage_bytes", "Bytes held.", labels=["tier"])
    cap = GaugeMetricFamily(_P + "kv_tier_capacity_bytes", "Byte budget.", labels=["tier"])
    blocks = GaugeMetricFamily(_P + "kv_tier_blocks", "Blocks held.", labels=["tier"])
    for t in tiers:
        load.add_metric([t.name], t.loads, t.load_seconds)
        used.add_metric([t.name], t.used_bytes)
        cap.add_metric([t.name], t.capacity_bytes)
        blocks.add_metric([t.name], t.blocks)
    yield from (load, used, cap, blocks)


class EngineMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStateCollector(stats))
        r = self.registry
        self.ttft = Histogram(
            _P + "time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            _P + "time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            _P + "e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            _P + "prompt_tokens", "Prompt tokens of ended requests.", registry=r
        )
        self.generation_tokens = Counter(
            _P + "generation_tokens", "Generated tokens of ended requests.", registry=r
        )
        self.finished = Counter(
            _P + "request_success",
            "Ended requests by finish reason (abort: the client left).",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            _P + "request_rejected",
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


class TutorCollector(Collector):
    """The tutor's costs, reply cache, breakers and quotas, read at scrape time. Labels are
    bounded: agents, tiers and courses are fixed at startup; schools and models beyond
    `costs.MAX_LABEL_VALUES` count as "other"."""

    def __init__(self, tutor: TutorService) -> None:
        self.tutor = tutor

    def collect(self) -> Iterator[Metric]:
        t = self.tutor
        costs = t.ledger.snapshot()
        where = ["school", "course", "agent", "model", "tier"]
        tokens = CounterMetricFamily(
            _P + "tutor_tokens",
            "Model tokens spent by tutor agents (kind: prompt, cached — of prompt, served from "
            "the prefix cache — or generated).",
            labels=["kind", *where],
        )
        for key, n in costs["tokens"].items():
            tokens.add_metric(list(key), n)
        seconds = CounterMetricFamily(
            _P + "tutor_model_seconds", "Wall seconds of tutor model calls.", labels=where
        )
        calls = CounterMetricFamily(_P + "tutor_model_calls", "Tutor model calls.", labels=where)
        for key, v in costs["seconds"].items():
            seconds.add_metric(list(key), v)
        for key, n in costs["calls"].items():
            calls.add_metric(list(key), n)
        turns = CounterMetricFamily(
            _P + "tutor_turns", "Tutor turns stored.", labels=["school", "course"]
        )
        for key, n in costs["turns"].items():
            turns.add_metric(list(key), n)
        yield from (tokens, seconds, calls, turns)
        if (cache := t.routing.cache) is not None:
            stats = cache.stats()
            for name, doc in (
                ("hits", "Agent calls answered from the reply cache."),
                ("misses", "Agent calls the reply cache did not know."),
                ("saved_tokens", "Model tokens the reply cache's hits did not spend."),
            ):
                family = CounterMetricFamily(
                    _P + f"tutor_reply_cache_{name}", doc, labels=["agent"]
                )
                for agent, n in stats[name].items():
                    family.add_metric([agent], n)
                yield family
        state = GaugeMetricFamily(
            _P + "tutor_breaker_open",
            "1 while a model endpoint's circuit breaker is open (0.5 half-open).",
            labels=["model"],
        )
        opened = CounterMetricFamily(
            _P + "tutor_breaker_opened", "Times the breaker opened.", labels=["model"]
        )
        for model, b in t.routing.health().items():
            state.add_metric([model], {"closed": 0.0, "half_open": 0.5, "open": 1.0}[b["state"]])
            opened.add_metric([model], b["times_opened"])
        yield from (state, opened)
        if (q := t.quotas) is not None:
            over = CounterMetricFamily(
                _P + "tutor_quota_exceeded", "Turns beyond a school's quota.", labels=["action"]
            )
            over.add_metric(["refused"], q.refused)
            over.add_metric(["degraded"], q.degraded)
            yield over
