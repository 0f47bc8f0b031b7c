"""Admission order within a priority: which waiting request the scheduler admits next.

A policy is chosen once, by name (`EngineConfig.scheduling`), when the scheduler starts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tutorserve.engine.kv_cache_manager import KVCacheManager
from tutorserve.engine.sequence import Sequence


class AdmissionPolicy(ABC):
    name: str
    # Whether a later arrival may be admitted before an earlier one of its priority (which the
    # scheduler then charges to the earlier one as a bypass, up to `max_bypass`).
    passes_over: bool

    @abstractmethod
    def order(
        self, window: list[Sequence], kv: KVCacheManager, max_bypass: int
    ) -> list[tuple[Sequence, list[int] | None]]:
        """The first waiting requests (queue order: priority, then arrival) in admission
        order, with their prefix-cache hits where the order needed them (None: looked up on
        admission)."""


class FirstComeFirstServed(AdmissionPolicy):
    name, passes_over = "fcfs", False

    def order(
        self, window: list[Sequence], kv: KVCacheManager, max_bypass: int
    ) -> list[tuple[Sequence, list[int] | None]]:
        return [(seq, None) for seq in window]


class CacheAware(AdmissionPolicy):
    """Longest cached prefix first (SGLang's LPM), so the students of a course whose prompt was
    just computed start before a new course's long prefill; a request bypassed `max_bypass`
    times goes first, which bounds how long anyone can be passed over."""

    name, passes_over = "cache-aware", True

    def order(
        self, window: list[Sequence], kv: KVCacheManager, max_bypass: int
    ) -> list[tuple[Sequence, list[int] | None]]:
        ranked = [(seq, kv.match_prefix(seq)) for seq in window]
        ranked.sort(
            key=lambda c: (
                c[0].priority,
                c[0].num_bypassed < max_bypass,
                -len(c[1]),
                c[0].arrival_order,
            )
        )
        return ranked


POLICIES: dict[str, AdmissionPolicy] = {p.name: p for p in (CacheAware(), FirstComeFirstServed())}


def policy_named(name: str) -> AdmissionPolicy:
    if name not in POLICIES:
        raise ValueError(f"scheduling must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]
