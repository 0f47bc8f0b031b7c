"""One tutoring turn as a LangGraph DAG of agents:

    START ─┬─ diagnose ─┬─ explain (streamed) ── assess ── engage (after the final event)
           └─ retrieve ─┘

`diagnose` and `retrieve` run in parallel; `explain` waits for both; the student's wait ends with
`assess` (the final event), while `engage` runs after it, off the critical path. Every node has a
timeout and a fallback built from the course's authored text, so a slow or failing model call
costs the student a template hint, never a stalled turn. Each node is one OpenTelemetry span.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from opentelemetry import context as otel_context
from opentelemetry import trace

from tutorserve.tutor import prompts
from tutorserve.tutor.agents import (
    TurnContext,
    assess_answer,
    engage_fallback,
    explain_fallback,
    judge,
    retrieve_material,
    verdict,
)
from tutorserve.tutor.ladder import MAX_LEVEL, AnswerLeak, RejectedReply, guarded
from tutorserve.tutor.llm_client import complete

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tutorserve.tutor")
_LABEL = re.compile(r"\b(" + "|".join(map(re.escape, prompts.ERROR_LABELS)) + r")\b", re.I)


@dataclass(slots=True)
class Timeouts:
    """Seconds each agent may take before its fallback is used."""

    diagnose: float = 20.0
    retrieve: float = 2.0
    explain: float = 60.0
    assess: float = 10.0
    engage: float = 20.0


def _merge(a: dict, b: dict) -> dict:
    return {**a, **b}


class TurnState(TypedDict, total=False):
    ctx: TurnContext
    diagnosis: dict[str, Any]
    material: list[str]
    reply: str
    outcome: dict[str, Any]
    engage: str
    steps: Annotated[dict[str, dict[str, float]], _merge]
    fallbacks: Annotated[list[str], operator.add]


Node = Callable[[TurnState], Awaitable[dict[str, Any]]]


def _agent(
    name: str, timeout: Callable[[Timeouts], float], fallback: Callable[[TurnState], dict]
) -> Callable[[Node], Node]:
    """A node with a span, a timing record, a timeout and a fallback on timeout or error."""

    def wrap(fn: Node) -> Node:
        async def node(state: TurnState) -> dict[str, Any]:
            ctx = state["ctx"]
            start = time.monotonic()
            with tracer.start_as_current_span(
                f"tutor.{name}",
                context=ctx.trace_parent or otel_context.get_current(),
                attributes={"tutor.session": ctx.session_id, "tutor.problem": ctx.problem.id},
            ) as span:
                try:
                    out = await asyncio.wait_for(fn(state), timeout(ctx.timeouts))
                    used = []
                except Exception as e:  # a timeout or a failed model call: the turn goes on
                    reason = "timeout" if isinstance(e, TimeoutError) else type(e).__name__
                    log.warning("tutor %s fell back (%s: %s)", name, reason, e)
                    span.set_attribute("tutor.fallback", reason)
                    out, used = fallback(state), [name]
            t0 = ctx.started
            step = {"start_ms": (start - t0) * 1e3, "end_ms": (time.monotonic() - t0) * 1e3}
            return {**out, "steps": {name: step}, "fallbacks": out.get("fallbacks", []) + used}

        return node

    return wrap


def _judged(state: TurnState) -> dict[str, Any]:
    return {"diagnosis": judge(state["ctx"])}


@_agent("diagnose", lambda t: t.diagnose, _judged)
async def diagnose(state: TurnState) -> dict[str, Any]:
    ctx = state["ctx"]
    d = judge(ctx)
    if d["kind"] == "answer" and not d["correct"] and d["source"] != "authored":
        text = await complete(
            ctx.llm,
            prompts.diagnose_messages(ctx.course, ctx.problem, ctx.message, ctx.history),
            max_tokens=40,
            session_id=ctx.session_id,
        )
        # Only a reply in the asked form is used: free text from a confused model would
        # otherwise flow into the explanation prompt.
        if label := _LABEL.match(text.strip()):
            reason = text.strip()[label.end() :].lstrip(" :-").split("\n")[0]
            d |= {"label": label[1].lower(), "reason": reason, "source": "model"}
    return {"diagnosis": d}


@_agent("retrieve", lambda t: t.retrieve, lambda s: {"material": []})
async def retrieve(state: TurnState) -> dict[str, Any]:
    # Retrieval is plain code that may be slow (a search index); keep it off the event loop.
    return {"material": await asyncio.to_thread(retrieve_material, state["ctx"])}


def _explain_fallback(state: TurnState) -> dict[str, Any]:
    ctx, d = state["ctx"], state["diagnosis"]
    reply = verdict(d) + explain_fallback(ctx, d)
    write = get_stream_writer()
    write({"event": "reset"})
    write({"event": "delta", "text": reply})
    return {"reply": reply}


@_agent("explain", lambda t: t.explain + 1.0, _explain_fallback)
async def explain(state: TurnState) -> dict[str, Any]:
    """The model's reply for this rung, streamed through the guard; the verdict ("Correct!",
    "Not quite.") comes from code first, so even a confused model cannot get it wrong."""
    ctx, d = state["ctx"], state["diagnosis"]
    level, said = d["level"], verdict(d)
    write = get_stream_writer()
    shown: list[str] = []

    def emit(text: str) -> None:
        shown.append(text)
        write({"event": "delta", "text": text})

    def restart() -> None:
        shown.clear()
        write({"event": "reset"})
        emit(said)

    async def generate() -> str:
        for strict in (False, True):
            messages = prompts.explain_messages(
                ctx.course, ctx.problem, ctx.message, ctx.history, level,
                d.get("reason", ""), state.get("material", []), strict,
            )  # fmt: skip
            deltas = ctx.llm.stream(
                messages, max_tokens=96, temperature=0.3, session_id=ctx.session_id
            )
            # The answer is the point of a confirmation or a correction: no guard there.
            watched = None if level in (0, MAX_LEVEL) else ctx.problem
            try:
                return await guarded(deltas, watched, emit)
            except AnswerLeak:
                log.info("tutor reply leaked the answer (strict=%s); regenerating", strict)
                restart()
        raise AnswerLeak("the model gave the answer away twice")

    emit(said)
    try:
        reply = _whole_sentences(await asyncio.wait_for(generate(), ctx.timeouts.explain))
        if not reply:
            raise ValueError("the model returned an empty reply")
        why = prompts.unfit_reply(reply, [r for _, r in ctx.history])
        if why is None and level == 2 and "?" not in reply:
            why = "it asks no question on the guiding-question rung"
        if why:
            raise RejectedReply(why)
        return {"reply": said + reply}
    except RejectedReply as e:  # leaked twice, or unfit: the authored text for this rung
        log.info("tutor reply rejected (%s); using the authored text", e)
    except (TimeoutError, ValueError) as e:
        log.warning("tutor explain fell back (%s: %s)", type(e).__name__, e)
        if "".join(shown) != said:  # keep what the student already saw rather than replace it
            return {"reply": "".join(shown), "fallbacks": ["explain"]}
    restart()
    emit(explain_fallback(ctx, d))
    return {"reply": "".join(shown), "fallbacks": ["explain"]}


def _whole_sentences(text: str) -> str:
    """`text` without a sentence the token limit cut off (the page shows the final reply)."""
    text = text.strip()
    if text.endswith((".", "!", "?")):
        return text
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", text)]
    return text[: ends[-1]] if ends else text


@_agent("assess", lambda t: t.assess, lambda s: {"outcome": {}})
async def assess(state: TurnState) -> dict[str, Any]:
    ctx = state["ctx"]
    return {"outcome": await asyncio.to_thread(assess_answer, ctx, state["diagnosis"])}


@_agent("engage", lambda t: t.engage, lambda s: {"engage": engage_fallback(s["ctx"])})
async def engage(state: TurnState) -> dict[str, Any]:
    ctx = state["ctx"]
    progress = ", ".join(
        f"{ctx.course.kc[k].name}: {v['after']:.0%}"
        for k, v in state.get("outcome", {}).get("mastery_changes", {}).items()
    )
    text = await complete(
        ctx.llm,
        prompts.engage_messages(ctx.course, ctx.history, progress or "just started"),
        max_tokens=40,
        temperature=0.5,
        session_id=ctx.session_id,
    )
    # One sentence, or the template: a rambling model is not encouraging.
    first = re.split(r"(?<=[.!])\s", text.strip(), maxsplit=1)[0]
    fit = 10 <= len(first) <= 200 and prompts.unfit_reply(first, [ctx.message]) is None
    return {"engage": first if fit else engage_fallback(ctx)}


def build_turn_graph() -> Any:
    g = StateGraph(TurnState)
    agents = [diagnose, retrieve, explain, assess, engage]
    for name, node in zip(
        ("diagnose", "retrieve", "explain", "assess", "engage"), agents, strict=True
    ):
        g.add_node(name, node)
    g.add_edge(START, "diagnose")
    g.add_edge(START, "retrieve")
    g.add_edge(["diagnose", "retrieve"], "explain")
    g.add_edge("explain", "assess")
    g.add_edge("assess", "engage")
    g.add_edge("engage", END)
    return g.compile()
