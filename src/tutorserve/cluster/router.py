"""Our routing policy as Ray Serve's request router (its custom request-router API), so Serve
itself sends each request to the replica the policy picks; no proxy of ours stands in front.

Serve makes one router per deployment handle per process; the ingress is one process, so one
router sees every request. It reads the routing facts from the call's keyword arguments (the
prompt's block hashes, the session, the adapter), counts each replica's requests from routed to
completed, reads which adapters each replica holds in its slots from what the replica reports
to Serve (`EngineReplica.record_routing_stats`, every few seconds), and tells the policy where
each request went once the replica accepted it.
"""

from __future__ import annotations

from collections import Counter

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from tutorserve.cluster.routing import Candidate, RouteRequest, RoutingPolicy, policy_named


def route_request(pending: PendingRequest) -> RouteRequest:
    kw = pending.kwargs
    return RouteRequest(kw.get("block_hashes") or [], kw.get("session_id"), kw.get("lora"))


class TutorserveRouter(RequestRouter):
    def initialize_state(self, policy: str = "cache-aware", balance: int = 4) -> None:
        self.policy: RoutingPolicy = policy_named(policy)
        if hasattr(self.policy, "balance"):
            self.policy.balance = balance
        self.inflight: Counter[str] = Counter()
        self._owner: dict[str, str] = {}  # internal request id → replica

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [
            Candidate(rid, self.inflight[rid], frozenset(r.routing_stats.get("adapters", ())))
            for rid, r in by_id.items()
        ]
        groups = self.policy.rank(candidates, route_request(pending_request))
        return [[by_id[rid] for rid in group] for group in groups if group]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        rid = replica_id.unique_id
        self.inflight[rid] += 1
        self._owner[pending_request.metadata.internal_request_id] = rid
        self.policy.routed(route_request(pending_request), rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._owner.pop(internal_request_id, None)
        if rid is not None:
            self.inflight[rid] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        self.policy.forget(live)
        self.inflight = Counter({r: n for r, n in self.inflight.items() if r in live})
