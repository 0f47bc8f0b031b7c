"""The tutoring agents, one module each, every one an `Agent` (name, timeout, run, fallback):
diagnose, retrieve, explain, assess, engage. The graph wires them; the service sets timeouts."""

from __future__ import annotations

from collections.abc import Mapping

from tutorserve.tutor.agents import assess, diagnose, engage, explain, retrieve
from tutorserve.tutor.agents.agent import Agent

AGENTS: dict[str, Agent] = {
    a.name: a for a in (diagnose.AGENT, retrieve.AGENT, explain.AGENT, assess.AGENT, engage.AGENT)
}
CRITICAL_STEPS = tuple(name for name, a in AGENTS.items() if a.critical)


def timeouts(overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    """Every agent's timeout: its own default unless `overrides` names it."""
    overrides = dict(overrides or {})
    if unknown := set(overrides) - set(AGENTS):
        names = ", ".join(sorted(unknown))
        raise ValueError(f"no agent named {names}; the agents: {', '.join(AGENTS)}")
    if bad := [n for n, t in overrides.items() if not t > 0]:
        raise ValueError(f"timeouts must be positive seconds: {', '.join(bad)}")
    return {name: overrides.get(name, a.timeout) for name, a in AGENTS.items()}
