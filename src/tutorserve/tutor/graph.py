"""One tutoring turn as a LangGraph DAG of agents:

    START ─┬─ diagnose ─┬─ explain (streamed) ── assess ── engage (after the final event)
           └─ retrieve ─┘

`diagnose` and `retrieve` run in parallel; `explain` waits for both; the student's wait ends with
`assess` (the final event), while `engage` runs after it, off the critical path. The state is
data (`TurnState`); the services come as the run's context (`TutorContext`).
"""

from __future__ import annotations

from typing import Any

from langgraph.graph import END, START, StateGraph

from tutorserve.tutor.agents import AGENTS, assess, diagnose, engage, explain, retrieve
from tutorserve.tutor.turn import TurnState, TutorContext


def build_turn_graph() -> Any:
    g = StateGraph(TurnState, context_schema=TutorContext)
    for agent in AGENTS.values():
        g.add_node(agent.name, agent.node())
    first = [diagnose.AGENT.name, retrieve.AGENT.name]
    for name in first:
        g.add_edge(START, name)
    g.add_edge(first, explain.AGENT.name)
    g.add_edge(explain.AGENT.name, assess.AGENT.name)
    g.add_edge(assess.AGENT.name, engage.AGENT.name)
    g.add_edge(engage.AGENT.name, END)
    return g.compile()
