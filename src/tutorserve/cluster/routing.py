"""Which replica serves a request: a policy object, chosen once (`--routing`), that ranks the
replicas Serve offers. Plain Python (no Ray): `router.py` adapts it to Serve's request router.

A policy ranks candidates into groups, best first; Serve takes the least-loaded replica of the
first group that has room. The cache-aware policy keeps an approximate index of which replica
was sent which chained KV block hashes (the engine's own hashes of the prompt's full blocks),
as SGLang's router does, rather than following each engine's stored/evicted blocks: routing
needs no event stream from the replicas, and a stale entry costs only a cache miss there. The
index is bounded (LRU) and forgets a replica that leaves.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Candidate:
    replica: str  # a replica's id
    load: int  # requests this router sent it that have not ended
    adapters: frozenset[str] = frozenset()  # LoRA adapters in its compute slots (last report)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks
    session_id: str | None = None
    lora: str | None = None


class RoutingPolicy(ABC):
    name: str

    @abstractmethod
    def rank(self, candidates: list[Candidate], request: RouteRequest) -> list[list[str]]:
        """Replica ids in groups, best first (every candidate in some group)."""

    def routed(self, request: RouteRequest, replica: str) -> None:  # noqa: B027 (a hook)
        """`replica` accepted `request` (stateless policies keep nothing)."""

    def forget(self, live: set[str]) -> None:  # noqa: B027 (a hook)
        """Only the replicas in `live` remain."""


def _by_load(candidates: list[Candidate]) -> list[str]:
    return [c.replica for c in sorted(candidates, key=lambda c: c.load)]


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(self, candidates: list[Candidate], request: RouteRequest) -> list[list[str]]:
        ids = sorted(c.replica for c in candidates)
        k = next(self._turn) % len(ids)
        return [[r] for r in ids[k:] + ids[:k]]


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"

    def rank(self, candidates: list[Candidate], request: RouteRequest) -> list[list[str]]:
        return [[r] for r in _by_load(candidates)]


def _lacks_adapter(c: Candidate, request: RouteRequest) -> bool:
    """The request names an adapter this replica does not hold in a slot (it would load it)."""
    return request.lora is not None and request.lora not in c.adapters


def _by_adapter_then_load(candidates: list[Candidate], request: RouteRequest) -> list[str]:
    """Least loaded first, but replicas holding the request's adapter in a slot before the rest
    (no adapter load on the way)."""
    return [c.replica for c in
            sorted(candidates, key=lambda c: (_lacks_adapter(c, request), c.load))]  # fmt: skip


class SessionAffinity(RoutingPolicy):
    """A session's turns go to the replica that served it while it lives (its history's KV is
    there); anything else to the least loaded, preferring replicas that hold its adapter."""

    name = "session"
    max_sessions = 1 << 16

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def _sticky(self, candidates: list[Candidate], request: RouteRequest) -> str | None:
        replica = self._sessions.get(request.session_id) if request.session_id else None
        return replica if any(c.replica == replica for c in candidates) else None

    def rank(self, candidates: list[Candidate], request: RouteRequest) -> list[list[str]]:
        sticky = self._sticky(candidates, request)
        rest = _by_adapter_then_load(candidates, request)
        return [[r] for r in ([sticky] if sticky else []) + [r for r in rest if r != sticky]]

    def routed(self, request: RouteRequest, replica: str) -> None:
        if request.session_id:
            self._sessions[request.session_id] = replica
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)

    def forget(self, live: set[str]) -> None:
        self._sessions = OrderedDict((s, r) for s, r in self._sessions.items() if r in live)


class CacheAware(SessionAffinity):
    """Sessions stick; otherwise the replica that was sent the longest run of this prompt's
    leading blocks, unless its load exceeds the least loaded's by more than `balance` requests
    (then the least loaded: a popular course must not pile onto one replica). A prompt no
    replica was sent goes, within the balance, to the replica sent the fewest blocks (SGLang's
    router picks the smallest tree): new courses spread over the pools instead of following
    whichever replica is idle at that moment, which at low load may be the same one for all."""

    name = "cache-aware"
    max_blocks = 1 << 18

    def __init__(self, balance: int = 4) -> None:
        super().__init__()
        self.balance = balance
        self._blocks: OrderedDict[bytes, str] = OrderedDict()
        self._sent: Counter[str] = Counter()  # blocks in the index, by replica

    def prefix_owner(self, candidates: list[Candidate], request: RouteRequest) -> str | None:
        live = {c.replica for c in candidates}
        owner = None
        for h in request.block_hashes:
            replica = self._blocks.get(h)
            if replica not in live:
                break
            owner = replica
        return owner

    def rank(self, candidates: list[Candidate], request: RouteRequest) -> list[list[str]]:
        order = _by_adapter_then_load(candidates, request)
        best = self._sticky(candidates, request) or self.prefix_owner(candidates, request)
        load = {c.replica: c.load for c in candidates}
        least = min(load.values())
        within = [r for r in order if load[r] - least <= self.balance]
        if best is None and request.block_hashes:
            lacks = {c.replica: _lacks_adapter(c, request) for c in candidates}
            best = min(within, key=lambda r: (lacks[r], self._sent[r], load[r]))
        if best in within:
            order = [best, *(r for r in order if r != best)]
        return [[r] for r in order]

    def routed(self, request: RouteRequest, replica: str) -> None:
        super().routed(request, replica)
        for h in request.block_hashes:
            if (before := self._blocks.get(h)) is not None:
                self._sent[before] -= 1
            self._blocks[h] = replica
            self._blocks.move_to_end(h)
            self._sent[replica] += 1
        while len(self._blocks) > self.max_blocks:
            self._sent[self._blocks.popitem(last=False)[1]] -= 1

    def forget(self, live: set[str]) -> None:
        super().forget(live)
        self._blocks = OrderedDict((h, r) for h, r in self._blocks.items() if r in live)
        self._sent = Counter(self._blocks.values())


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, SessionAffinity, CacheAware)
}


def policy_named(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]()
