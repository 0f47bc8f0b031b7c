"""The tutor's Prometheus metrics, read at scrape time: its costs, reply cache, breakers, hedged
calls and quotas (`metrics.py` exports the engine's)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tutorserve.server.metrics import PREFIX
from tutorserve.tutor.service import TutorService


class TutorCollector(Collector):
    """The tutor's costs, reply cache, breakers, hedged calls and quotas. Labels are
    bounded: agents, tiers and courses are fixed at startup; schools and models beyond
    `costs.MAX_LABEL_VALUES` count as "other"."""

    def __init__(self, tutor: TutorService) -> None:
        self.tutor = tutor

    def collect(self) -> Iterator[Metric]:
        t = self.tutor
        costs = t.ledger.snapshot()
        where = ["school", "course", "agent", "model", "tier"]
        tokens = CounterMetricFamily(
            PREFIX + "tutor_tokens",
            "Model tokens spent by tutor agents (kind: prompt, cached — of prompt, served from "
            "the prefix cache — or generated).",
            labels=["kind", *where],
        )
        for key, n in costs["tokens"].items():
            tokens.add_metric(list(key), n)
        seconds = CounterMetricFamily(
            PREFIX + "tutor_model_seconds", "Wall seconds of tutor model calls.", labels=where
        )
        calls = CounterMetricFamily(
            PREFIX + "tutor_model_calls", "Tutor model calls.", labels=where
        )
        for key, v in costs["seconds"].items():
            seconds.add_metric(list(key), v)
        for key, n in costs["calls"].items():
            calls.add_metric(list(key), n)
        turns = CounterMetricFamily(
            PREFIX + "tutor_turns", "Tutor turns stored.", labels=["school", "course"]
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
                    PREFIX + f"tutor_reply_cache_{name}", doc, labels=["agent"]
                )
                for agent, n in stats[name].items():
                    family.add_metric([agent], n)
                yield family
        state = GaugeMetricFamily(
            PREFIX + "tutor_breaker_open",
            "1 while a model endpoint's circuit breaker is open (0.5 half-open).",
            labels=["model"],
        )
        opened = CounterMetricFamily(
            PREFIX + "tutor_breaker_opened", "Times the breaker opened.", labels=["model"]
        )
        hedged = CounterMetricFamily(
            PREFIX + "tutor_hedged_calls",
            "Calls late at their model that were also sent a tier down (won: the hedge "
            "answered first).",
            labels=["model", "outcome"],
        )
        for model, b in t.routing.health().items():
            state.add_metric([model], {"closed": 0.0, "half_open": 0.5, "open": 1.0}[b["state"]])
            opened.add_metric([model], b["times_opened"])
            if "hedged" in b:
                hedged.add_metric([model, "won"], b["hedges_won"])
                hedged.add_metric([model, "lost"], b["hedged"] - b["hedges_won"])
        yield from (state, opened, hedged)
        if (q := t.quotas) is not None:
            over = CounterMetricFamily(
                PREFIX + "tutor_quota_exceeded", "Turns beyond a school's quota.", labels=["action"]
            )
            over.add_metric(["refused"], q.refused)
            over.add_metric(["degraded"], q.degraded)
            yield over
