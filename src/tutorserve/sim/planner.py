"""`tutorserve plan`: replicas a district needs at its evening peak, per serving policy.

Demand: students × peak fraction are in a session at the peak, each sending a message every
`Cohort.turn_interval_s` on average (their think time; the reply's own time is left out, which
errs towards more machines). Supply: the largest rate of sessions a small simulated cluster
(`sim_replicas` replicas) serves with at least `attainment` of its turns meeting the SLOs, found
by bisection on the simulator; per replica, that rate's turns per second. Each simulation lets
turns arrive for 1.5 session lengths (or turn intervals, for one-turn sessions) and counts only
those of the last two thirds (the session population is steady by then), so the empty cluster
at the start does not flatter it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from tutorserve.bench.serving_metrics import SLO
from tutorserve.bench.step_cost import StepCostModel
from tutorserve.engine.scheduler import StepShape
from tutorserve.models.config import ModelConfig
from tutorserve.sim.setup import GIB, Deployment, kv_bytes_per_token
from tutorserve.sim.simulator import SimResult
from tutorserve.sim.workload import Cohort

_BISECTIONS = 5


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    routing: str
    prefix_caching: bool
    ram_tier: bool = False
    prefill_share: float = 0.0  # of the replicas, prefill-only (P/D split; 0: none)


POLICIES = (
    Policy("no prefix cache, round-robin", "round-robin", False),
    Policy("prefix cache, round-robin", "round-robin", True),
    Policy("prefix cache, cache-aware routing", "cache-aware", True),
    Policy("prefix cache + RAM tier, cache-aware routing", "cache-aware", True, ram_tier=True),
    # KV moves over a simulated link; the cluster's split (cluster/disagg.py) moves it through
    # the shared disk tier.
    Policy("prefix cache, cache-aware, P/D split 1:1", "cache-aware", True, prefill_share=0.5),
)


@dataclass(slots=True)
class Capacity:
    policy: str
    students: int
    demand_turns_per_s: float
    turns_per_s_per_replica: float
    replicas: int
    cost_per_1000_turns: float | None
    at_capacity: dict[str, float]  # the simulated summary at the rate found


def steady_attainment(result: SimResult, slo: SLO, since: float) -> tuple[float, dict[str, Any]]:
    counted = [r for r in result.records() if r.start >= since]
    if not counted:
        return 0.0, {}
    met = sum(slo.met(r) for r in counted)
    summary = result.summary(slo)
    return met / len(counted), summary


def kv_wall(cfg: ModelConfig, kv_bytes: float, dtype: str, cohort: Cohort) -> dict[str, Any]:
    """The memory wall of one replica (the seed studies' formula): KV bytes per token, the
    tokens its KV budget holds, and how many sessions' KV fits at once (an active session holds
    its course prompt, its history and its reply) — each with its own copy of the course
    prompt, or sharing one copy per course (prefix caching) when the replica serves one course
    or every course."""
    per_token = kv_bytes_per_token(cfg, dtype)
    tokens = int(kv_bytes // per_token)
    c = cohort
    history = (c.turns / 2) * (sum(c.message_tokens) / 2 + sum(c.reply_tokens) / 2)
    own = c.course_prompt_tokens + history

    def shared(courses: int) -> int:
        return max(0, int((tokens - courses * c.course_prompt_tokens) // history))

    return {
        "formula": "KV bytes/token = 2 (K,V) × layers × KV heads × head dim × bytes",
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_token_terms": f"2 × {cfg.num_layers} × {cfg.num_kv_heads} × "
        f"{cfg.head_dim} × {per_token // cfg.kv_bytes_per_token(1)}",
        "kv_budget_gib": kv_bytes / GIB,
        "kv_tokens": tokens,
        "mean_session_tokens": own,
        "sessions_without_sharing": int(tokens // own),
        "sessions_sharing_one_course": shared(1),
        "sessions_sharing_all_courses": shared(c.courses),
    }


class Planner:
    def __init__(self, cost: StepCostModel, deployment: Deployment, cohort: Cohort, vocab: int,
                 slo: SLO, attainment: float = 0.9, seed: int = 0) -> None:  # fmt: skip
        self.cost = cost
        self.deployment = deployment
        self.cohort = cohort
        self.vocab = vocab
        self.slo = slo
        self.attainment = attainment
        self.seed = seed

    def session_seconds(self) -> float:
        c = self.cohort
        return (c.turns - 1) * c.turn_interval_s()

    def attained(self, deployment: Deployment, session_rate: float) -> tuple[float, dict]:
        horizon = 1.5 * max(self.session_seconds(), self.cohort.turn_interval_s())
        n = max(1, round(session_rate * horizon))
        sessions = self.cohort.sessions(self.vocab, n, session_rate, self.seed)
        result = deployment.simulation(self.cost, self.vocab).run(sessions, last_arrival=horizon)
        return steady_attainment(result, self.slo, horizon / 3)

    def decode_bound(self, d: Deployment) -> float:
        """Sessions per second the replicas could start if every step were a full batch of
        decodes (no prefill at all): an upper bound to start the search from."""
        c, spec = self.cohort, d.spec
        context = (
            c.course_prompt_tokens + c.turns * (sum(c.message_tokens) + sum(c.reply_tokens)) / 4
        )
        step = self.cost.step_seconds(StepShape(((1, int(context)),) * spec.max_num_seqs))
        turns_per_s = spec.max_num_seqs / step / (sum(c.reply_tokens) / 2)
        return turns_per_s * d.replicas / c.turns

    def capacity(self, policy: Policy) -> tuple[float, dict[str, float]]:
        """Turns per second per replica at the SLOs, and the simulated summary there."""
        prefill = round(self.deployment.replicas * policy.prefill_share)
        d = self.deployment.with_options(policy.routing, policy.prefix_caching, policy.ram_tier,
                                         prefill)  # fmt: skip
        # Halve from the decode-only bound until a rate is served, then bisect.
        hi = self.decode_bound(d)
        lo, best = hi / 2, {}
        while (got := self.attained(d, lo))[0] < self.attainment:
            hi, lo = lo, lo / 2
            if lo < 1e-4 * self.decode_bound(d):
                raise ValueError(
                    f"{policy.name}: the SLOs are not met even at the lightest "
                    "load (is the TTFT SLO below one course prompt's prefill?)"
                )
        best = got[1]
        for _ in range(_BISECTIONS):
            mid = (lo + hi) / 2
            got = self.attained(d, mid)
            if got[0] >= self.attainment:
                lo, best = mid, got[1]
            else:
                hi = mid
        return lo * self.cohort.turns / d.replicas, best

    def demand(self, students: int, peak_fraction: float) -> float:
        """Turns per second at the peak."""
        if students < 1 or not 0 < peak_fraction <= 1:
            raise ValueError("need --students >= 1 and --peak-fraction in (0, 1]")
        return students * peak_fraction / self.cohort.turn_interval_s()

    def plan(self, students: list[int], peak_fraction: float, price_per_hour: float | None,
             policies: tuple[Policy, ...] = POLICIES) -> list[Capacity]:  # fmt: skip
        demands = [self.demand(n, peak_fraction) for n in students]
        if self.deployment.replicas < 2:  # a split needs a replica of each kind
            policies = tuple(p for p in policies if not p.prefill_share)
        out = []
        for policy in tqdm(policies, desc="policies"):
            per_replica, summary = self.capacity(policy)
            for n, demand in zip(students, demands, strict=True):
                replicas = math.ceil(demand / per_replica)
                cost = None
                if price_per_hour is not None:
                    cost = price_per_hour * replicas / (demand * 3600) * 1000
                out.append(Capacity(policy.name, n, demand, per_replica, replicas, cost, summary))
        return out
