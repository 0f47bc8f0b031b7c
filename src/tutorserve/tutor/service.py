"""The tutor service: sessions, turns and learner profiles over the course set, the store, the
agent graph and its services (the model routing, the retriever, the tracer). The HTTP layer
(`server/tutor_api.py`) only translates. Each turn is admitted by its school's quota and its
model calls are charged to the learner, session, course, school, agent and model.

A turn runs in its own task, independent of the connection that asked for it: a student who
closes the tab still has the answer assessed and the turn stored. The turn and what its attempt
changed are stored here, in one transaction, once `assess` is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Tracer

from tutorserve.engine.async_engine import AsyncEngine
from tutorserve.tutor.agents import CRITICAL_STEPS, assess, engage
from tutorserve.tutor.agents import timeouts as agent_timeouts
from tutorserve.tutor.agents.retrieve import course_material
from tutorserve.tutor.costs import Call, CostLedger, usage_summary
from tutorserve.tutor.courses import Course
from tutorserve.tutor.graph import build_turn_graph
from tutorserve.tutor.llm_client import ChatLLM
from tutorserve.tutor.profile import course_progress, kc_states, pick_problem
from tutorserve.tutor.prompts import HISTORY_TURNS, LEVEL_NAMES
from tutorserve.tutor.quotas import Admission, Quotas
from tutorserve.tutor.routing import Routing
from tutorserve.tutor.store import TutorStore
from tutorserve.tutor.turn import Retriever, Turn, TurnState, TutorContext
from tutorserve.tutor.usage_store import Charge, UsageStore

log = logging.getLogger(__name__)


class UnknownCourseError(ValueError):
    pass


class SessionBusyError(RuntimeError):
    pass


class TutorService:
    def __init__(
        self,
        courses: dict[str, Course],
        store: TutorStore,
        models: ChatLLM | Routing,
        *,
        timeouts: Mapping[str, float] | None = None,
        retriever: Retriever = course_material,
        tracer: Tracer | None = None,
        quotas: Quotas | None = None,
        engines: Iterable[AsyncEngine] = (),
    ) -> None:
        """`models`: one chat model for every agent, or a `Routing` (tiers, policy, breakers,
        reply cache). `timeouts`: seconds per agent name, for those not to keep their own
        default. `quotas`: per-school limits (none: unlimited). `engines`: engines the models
        run on besides the server's own, started and stopped with the service."""
        self.courses = courses
        self.store = store
        self.usage = UsageStore(store)
        self.routing = models if isinstance(models, Routing) else Routing.single(models)
        self.quotas = quotas
        self.engines = list(engines)
        self.ledger = CostLedger()
        self.retriever = retriever
        self.timeouts = agent_timeouts(timeouts)
        self.tracer = tracer or trace.get_tracer("tutorserve.tutor")
        self.graph = build_turn_graph()
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    def course(self, course_id: str) -> Course:
        if course_id not in self.courses:
            raise UnknownCourseError(
                f"unknown course {course_id!r}; available: {', '.join(sorted(self.courses))}"
            )
        return self.courses[course_id]

    def _course_of(self, stored_id: str) -> Course:
        try:
            return self.course(stored_id)
        except UnknownCourseError as e:
            raise KeyError(f"this session's course {stored_id!r} is no longer served") from e

    async def start_session(
        self, learner_id: str, course_id: str, school: str | None = None
    ) -> dict[str, Any]:
        """`school`: the tenant the learner belongs to from now on (kept if None)."""
        course = self.course(course_id)
        states, solved = await asyncio.to_thread(self._learner_state, learner_id, course)
        problem = pick_problem(course, states, solved) or course.problems[0]
        rec = await asyncio.to_thread(self.store.create_session, learner_id, course.id, problem.id)
        if school is not None:
            await asyncio.to_thread(self.usage.set_tenant, learner_id, school)
        return {
            "id": rec.id,
            "learner_id": learner_id,
            "course": course.id,
            "problem": problem.view(),
            **course_progress(course, states),
        }

    async def session(self, session_id: str) -> dict[str, Any]:
        rec = await asyncio.to_thread(self.store.get_session, session_id)
        if rec is None:
            raise KeyError(f"no tutoring session {session_id!r}")
        course = self._course_of(rec.course_id)
        turns = await asyncio.to_thread(self.store.turns, session_id)
        problem = course.problem.get(rec.problem_id or "")
        return {
            "id": rec.id,
            "learner_id": rec.learner_id,
            "course": rec.course_id,
            "problem": problem.view() if problem else None,
            "turns": [
                {
                    "message": t.message,
                    "reply": t.reply,
                    "ladder_level": t.ladder_level,
                    "diagnosis": t.diagnosis,
                    "engage": t.engage,
                }
                for t in turns
            ],
        }

    def _learner_state(self, learner_id: str, course: Course) -> tuple[dict, set[str]]:
        stored = self.store.mastery(learner_id, course.id)
        return kc_states(course, stored), self.store.solved(learner_id, course.id)

    async def start_turn(self, session_id: str, message: str) -> AsyncIterator[dict[str, Any]]:
        """Start a turn, or raise KeyError / SessionBusyError / QuotaExceeded before anything
        starts. The turn runs on its own; the returned iterator gives its events: `delta` and
        `reset` while the reply streams, then `final`, then `engage`. Nobody need read them."""
        rec = await asyncio.to_thread(self.store.get_session, session_id)
        if rec is None:
            raise KeyError(f"no tutoring session {session_id!r}")
        course = self._course_of(rec.course_id)
        if rec.problem_id is None or rec.problem_id not in course.problem:
            raise KeyError(f"session {session_id!r} has finished every problem of its course")
        tenant = await asyncio.to_thread(self.usage.tenant_of, rec.learner_id)
        if session_id in self._busy:
            raise SessionBusyError(f"session {session_id!r} is still answering the last turn")
        admission = self.quotas.admit(tenant) if self.quotas else Admission()
        self._busy.add(session_id)  # before any await, so a second request sees it
        try:
            states, solved = await asyncio.to_thread(self._learner_state, rec.learner_id, course)
            turns = await asyncio.to_thread(self.store.turns, session_id)
        except BaseException:
            self._busy.discard(session_id)
            raise
        turn = Turn(
            course=course,
            problem=course.problem[rec.problem_id],
            session_id=session_id,
            learner_id=rec.learner_id,
            message=message,
            history=tuple((t.message, t.reply) for t in turns[-HISTORY_TURNS:]),
            states=states,
            solved=frozenset(solved),
            started=time.monotonic(),
            tenant=tenant,
            cap=admission.cap,
            priority=admission.priority,
        )
        events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        task = asyncio.create_task(self._drive(turn, events))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return _drain(events)

    async def _drive(self, turn: Turn, events: asyncio.Queue) -> None:
        span = self.tracer.start_span(
            "tutor.turn",
            attributes={"tutor.session": turn.session_id, "tutor.course": turn.course.id},
        )
        services = TutorContext(
            routing=self.routing,
            retriever=self.retriever,
            timeouts=self.timeouts,
            tracer=self.tracer,
            trace_parent=trace.set_span_in_context(span),
        )
        index = None
        try:
            # "values" is the graph's state after each superstep, already merged by its reducers.
            async for mode, state in self.graph.astream(
                {"turn": turn}, context=services, stream_mode=["custom", "values"]
            ):
                if mode == "custom":
                    events.put_nowait(state)
                elif index is None and assess.AGENT.name in state.get("steps", {}):
                    final = self._final(turn, state)
                    span.end()
                    index = await asyncio.to_thread(self._save, turn, state, final)
                    self._busy.discard(turn.session_id)  # engage need not hold the next turn
                    events.put_nowait({"event": "final", "turn": index, **final})
                elif index is not None and "engage" in state:
                    await asyncio.to_thread(
                        self.store.set_engage, turn.session_id, index, state["engage"]
                    )
                    engage_calls = [c for c in state["calls"] if c.agent == engage.AGENT.name]
                    await asyncio.to_thread(self._charge, turn, engage_calls, False)
                    step = state["steps"][engage.AGENT.name]
                    took = round(step["end_ms"] - step["start_ms"], 1)
                    events.put_nowait(
                        {"event": "engage", "text": state["engage"], "duration_ms": took}
                    )
        except Exception as e:
            log.exception("tutor turn failed")
            events.put_nowait({"event": "error", "message": f"the turn failed: {e}"})
            if span.is_recording():
                span.end()
        finally:
            self._busy.discard(turn.session_id)
            events.put_nowait(None)

    def _final(self, turn: Turn, state: TurnState) -> dict[str, Any]:
        d, attempt = state["diagnosis"], state.get("attempt")
        steps = state["steps"]
        critical = (time.monotonic() - turn.started) * 1e3
        total = sum(s["end_ms"] - s["start_ms"] for n, s in steps.items() if n in CRITICAL_STEPS)
        nxt = turn.course.problem.get(attempt.next_problem or "") if attempt else None
        return {
            "reply": state.get("reply", ""),
            "diagnosis": d,
            "ladder_level": d["level"],
            "ladder": LEVEL_NAMES[d["level"]],
            "mastery_changes": attempt.mastery_changes if attempt else {},
            "problem": turn.problem.view(),
            "next_problem": nxt.view() if nxt else None,
            "fallbacks": state.get("fallbacks", []),
            "tiers": state.get("tiers", {}),
            "usage": usage_summary(state.get("calls", [])),
            "timing": {
                "critical_path_ms": round(critical, 1),
                "sum_of_steps_ms": round(total, 1),
                "steps": {n: {k: round(v, 1) for k, v in s.items()} for n, s in steps.items()},
            },
            **course_progress(turn.course, {**turn.states, **(attempt.states if attempt else {})}),
        }

    def _save(self, turn: Turn, state: TurnState, final: dict[str, Any]) -> int:
        index = self.store.add_turn(
            turn.session_id,
            turn.message,
            final["reply"],
            final["diagnosis"],
            final["ladder_level"],
            final["timing"] | {"tiers": final["tiers"]},
            state.get("attempt"),
        )
        self._charge(turn, state.get("calls", []), True)
        return index

    def _charge(self, turn: Turn, calls: list[Call], whole_turn: bool) -> None:
        """Costs to the store, the metrics ledger and the school's token quota."""
        charge = Charge(turn.learner_id, turn.session_id, turn.course.id, turn.tenant)
        self.usage.add(charge, calls)
        self.ledger.charge(turn.tenant, turn.course.id, calls, whole_turn)
        if self.quotas is not None:
            self.quotas.charge(turn.tenant, sum(c.tokens for c in calls if not c.cached_reply))

    def health(self) -> dict[str, Any]:
        """The model endpoints' circuit breakers, for /health."""
        return {"models": self.routing.health()}

    async def learner(self, learner_id: str) -> dict[str, Any]:
        if not await asyncio.to_thread(self.store.learner_exists, learner_id):
            raise KeyError(f"no learner {learner_id!r}")
        sessions = await asyncio.to_thread(self.store.sessions_of, learner_id)
        courses = []
        for course_id in dict.fromkeys(s.course_id for s in sessions):
            if course_id in self.courses:
                course = self.courses[course_id]
                states, solved = await asyncio.to_thread(self._learner_state, learner_id, course)
                courses.append(
                    {
                        "course": course.id,
                        "title": course.title,
                        "solved": len(solved),
                        "problems": len(course.problems),
                        **course_progress(course, states),
                    }
                )
        return {
            "learner_id": learner_id,
            "sessions": [
                {
                    "id": s.id,
                    "course": s.course_id,
                    "turns": s.num_turns,
                    "created_at": s.created_at.isoformat(),
                }
                for s in sessions
            ],
            "courses": courses,
        }

    async def start(self) -> None:
        for engine in self.engines:
            await engine.start()

    async def close(self) -> None:
        """Let turns still running finish (server shutdown), so none is lost half-done; then
        close the store and stop the service's own engines."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=30)
        self.store.close()
        for engine in self.engines:
            await engine.stop()


async def _drain(events: asyncio.Queue) -> AsyncIterator[dict[str, Any]]:
    while (event := await events.get()) is not None:
        yield event
