"""A discrete-event simulation of N engine replicas behind one of the cluster's routing policies.

Two kinds of event, in time order: a turn arrives (it is routed, as `cluster/router.py` routes,
with the policy object the cluster uses, and queued at its replica), and a replica's step ends
(its effects are applied, finished turns schedule their session's next turn after the student's
think time, and the replica schedules its next step at once if it has work). A replica with work
is never idle, as the engine's loop is not. Replicas do not share a clock's worth of anything but
the router, so each one's steps run back to back in virtual time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tutorserve.bench.serving_metrics import SLO, RequestRecord, summarize
from tutorserve.cluster.routing import Candidate, RouteRequest, RoutingPolicy
from tutorserve.paging import extend_block_hashes
from tutorserve.sim.replica import SimReplica, SimRequest


@dataclass(frozen=True, slots=True)
class SimTurn:
    # Token ids this turn adds after the previous turn's prompt and output (for the first turn,
    # its whole prompt): chat-template glue and the student's message.
    tokens: list[int]
    max_tokens: int
    think_time_s: float = 0.0  # after the previous turn's reply ends


@dataclass(frozen=True, slots=True)
class SimSession:
    turns: list[SimTurn]
    start: float  # when its first turn arrives
    course: int = 0


@dataclass(frozen=True, slots=True)
class ClientRun:
    """Sessions one client sends the replicas, and its cap on turns in flight (None: none; a
    benchmark's warm-up sends a few at a time)."""

    sessions: list[SimSession]
    max_concurrency: int | None = None


@dataclass(slots=True)
class SimResult:
    requests: list[SimRequest]
    replicas: list[SimReplica]
    rejected: int = 0  # turns no replica could ever hold (prompt beyond the KV pool)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        done = [r for r in self.requests if r.finish is not None]
        if not done:
            return 0.0
        return max(r.finish for r in done) - min(r.arrival for r in self.requests)

    def records(self) -> list[RequestRecord]:
        """In the benchmark client's terms, so the same `summarize` reads both (its chunk times
        are the first and last token: TTFT, TPOT and E2E are exact, ITLs are not kept)."""
        out = []
        for r in self.requests:
            chunks = [] if r.first_token is None else [r.first_token]
            if r.finish is not None and r.max_tokens > 1:
                chunks.append(r.finish)
            out.append(RequestRecord(r.session, r.turn, len(r.prompt), r.arrival, chunks,
                                     r.finish, r.max_tokens, r.num_cached_tokens))  # fmt: skip
        return out

    def summary(self, slo: SLO) -> dict[str, float]:
        duration = self.duration
        out = summarize(self.records(), duration, slo) if duration > 0 else {"completed": 0}
        query = sum(r.prefix_query_tokens for r in self.replicas)
        hits = sum(r.prefix_hit_tokens for r in self.replicas)
        blocks = sum(r.spec.num_kv_blocks for r in self.replicas)
        out |= {
            "prefix_cache_hit_rate": hits / query if query else math.nan,
            "preemptions": sum(r.preemptions for r in self.replicas),
            "mean_kv_occupancy": (sum(r.block_seconds for r in self.replicas) / blocks / duration
                                  if duration else math.nan),
            "peak_kv_occupancy": max(r.peak_used_blocks / r.spec.num_kv_blocks
                                     for r in self.replicas),
            "busy_fraction": (sum(r.busy_seconds for r in self.replicas)
                              / len(self.replicas) / duration if duration else math.nan),
            "mean_step_ms": (1000 * sum(r.busy_seconds for r in self.replicas) / steps
                             if (steps := sum(r.num_steps for r in self.replicas)) else math.nan),
            "rejected": self.rejected,
        }  # fmt: skip
        return out


class Simulation:
    """`replicas` serve requests whole, or with `decode` replicas given, only their prefill (and
    first token): the KV then travels to the least loaded decode replica, `transfer_s_per_token`
    a token, which copies it in from staging and decodes the rest (prefill/decode split)."""

    def __init__(
        self,
        replicas: list[SimReplica],
        routing: RoutingPolicy,
        decode: list[SimReplica] | None = None,
        transfer_s_per_token: float = 0.0,
    ) -> None:
        if not replicas:
            raise ValueError("a simulation needs at least one replica")
        self.replicas = replicas
        self.routing = routing
        self.decode = decode or []
        self.transfer_s_per_token = transfer_s_per_token
        self._everyone = self.replicas + self.decode  # for whether a replica's siblings step
        self.block_size = replicas[0].spec.block_size
        self._events: list[tuple[float, int, str, Any]] = []
        self._order = itertools.count()

    def _push(self, t: float, kind: str, data: Any) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, data))

    def run(
        self,
        sessions: list[SimSession],
        last_arrival: float = math.inf,
        earlier: Sequence[ClientRun] = (),
    ) -> SimResult:
        """Every session to its end, or to the last turn arriving by `last_arrival` seconds.
        `earlier`: what the same replicas served first, one run after another (a benchmark's
        warm-up and its earlier rates on one server): the routing index and the prefix caches
        they leave behind carry over, their requests and step counts do not."""
        start = 0.0
        for n, before in enumerate(earlier):
            start = self._serve(before, f"earlier{n}:", start, SimResult([], []))
        for r in self._everyone:
            r.start_counting()
        result = SimResult([], self.replicas + self.decode)
        self._serve(ClientRun(sessions), "", start, result, last_arrival)
        return result

    def _serve(
        self,
        run: ClientRun,
        tag: str,
        start: float,
        result: SimResult,
        last_arrival: float = math.inf,
    ) -> float:
        """`run`'s sessions from `start` to the last event, into `result`; the time it ends.
        `tag` keeps its sessions apart from other runs' at the router and in the tiers."""
        sessions, cap = run.sessions, run.max_concurrency
        prompts: dict[int, list[int]] = {}
        # A turn reaches an engine this long after its client sent it (its TTFT counts it).
        overhead = self.replicas[0].cost.request_overhead_s
        held: deque[tuple[int, int, float]] = deque()  # turns over the client's cap, in order
        in_flight = 0
        for i, s in enumerate(sessions):
            self._push(start + s.start + overhead, "arrive", (i, 0, start + s.start))
        now = start
        while self._events:
            now, _, kind, data = heapq.heappop(self._events)
            if kind == "arrive" and data[2] - start > last_arrival:
                continue
            if kind == "arrive" and cap is not None and in_flight >= cap:
                held.append(data)  # sent once a turn ends (its times are not scored)
                continue
            if kind == "arrive":
                i, k, sent = data
                turn = sessions[i].turns[k]
                prompt = prompts.pop(i, []) + turn.tokens
                req = SimRequest(f"{tag}s{i}t{k}", i, k, prompt, turn.max_tokens, sent,
                                 key=f"{tag}{i}")  # fmt: skip
                replica = self._route(req)
                if replica is None:
                    result.rejected += 1
                    continue
                in_flight += 1
                result.requests.append(req)
                replica.add(req, max_tokens=1 if self.decode else None)
                if not replica.busy:
                    self._step(replica, now)
            elif kind == "handoff":
                req = data
                replica = min(self.decode, key=lambda r: r.load)
                replica.receive_kv(req.prompt)
                replica.add(req, req.prompt + (req.output or []), req.max_tokens - 1)
                if not replica.busy:
                    self._step(replica, now)
            else:
                replica = data
                for req in replica.finish_step(now):
                    if self.decode and replica in self.replicas and req.max_tokens > 1:
                        req.finish = None
                        self._push(now + self.transfer_s_per_token * len(req.prompt), "handoff",
                                   req)  # fmt: skip
                        continue
                    in_flight -= 1
                    if held:
                        self._push(now, "arrive", held.popleft())
                    turns = sessions[req.session].turns
                    if req.turn + 1 < len(turns):
                        prompts[req.session] = req.prompt + (req.output or [])
                        sent = now + turns[req.turn + 1].think_time_s
                        self._push(sent + overhead, "arrive", (req.session, req.turn + 1, sent))
                self._step(replica, now)
        return now

    def _step(self, replica: SimReplica, now: float) -> None:
        # Replicas simulated side by side share a host as the calibrated ones did (a factor of
        # 1 where the calibration had one engine).
        sibling_busy = any(r.busy for r in self._everyone if r is not replica)
        seconds = replica.start_step(now, sibling_busy)
        if seconds is not None:
            self._push(now + seconds, "step", replica)

    def _route(self, req: SimRequest) -> SimReplica | None:
        pool = self.replicas[0].spec.num_kv_blocks * self.block_size
        if len(req.prompt) + req.max_tokens > pool:
            return None
        by_name = {r.name: r for r in self.replicas}
        req.block_hashes = extend_block_hashes([], req.prompt, self.block_size)
        route = RouteRequest(req.block_hashes, req.key)
        groups = self.routing.rank([Candidate(r.name, r.load) for r in self.replicas], route)
        # As Serve does: the least loaded of the first group (every group here has room).
        name = min(groups[0], key=lambda n: by_name[n].load)
        self.routing.routed(route, name)
        return by_name[name]
