"""Tutoring turns end to end on the real engine, in process: simulated students answer each
problem wrongly twice (an authored misconception, then another wrong value) and then rightly;
by default every student of a class the same way, or each its own way (`varied`).

Per turn it records the critical path (what the student waits for: diagnose ∥ retrieve →
explain → assess) against the sum of all five steps, engage included (what running them one
after another would cost); which rung of the ladder was used; whether the model's own reply
reached the student or the guard replaced it with the authored text; and the share of prompt
tokens the prefix cache served (every prompt of a course starts with the same course prefix).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tutorserve.config import EngineConfig
from tutorserve.engine.async_engine import AsyncEngine
from tutorserve.engine.engine import LLMEngine
from tutorserve.engine.outputs import RequestOutput
from tutorserve.engine.step_log import StepRecord
from tutorserve.tutor.agents import CRITICAL_STEPS
from tutorserve.tutor.courses import Course, Problem, load_courses
from tutorserve.tutor.llm_client import ChatLLM, EngineLLM, Messages
from tutorserve.tutor.service import TutorService
from tutorserve.tutor.store import TutorStore


@dataclass(slots=True)
class TurnSample:
    course: str
    student: int
    level: int
    model_reply_used: bool
    critical_path_ms: float
    sum_of_steps_ms: float
    steps_ms: dict[str, float]
    reply: str


def _answers(problem: Problem, variant: int = 0) -> list[str]:
    """A known mistake (diagnosed from the course), another wrong answer (diagnosed by the
    model), then the right answer. Each `variant` starts from another of the problem's authored
    mistakes and gives another second wrong answer, so that classmates' histories differ."""
    known = [m.answer for m in problem.misconceptions] or ["41"]
    first = known[variant % len(known)]
    if problem.answer_type == "numeric":
        other = f"x = {41 + variant}"
    else:
        other = known[(variant + 1) % len(known)] if len(known) > 1 else str(41 + variant)
    return [first, other, problem.answer]


async def _student(
    service: TutorService, course: Course, student: int, problems: int, varied: bool, bar: tqdm
) -> list[TurnSample]:
    session = await service.start_session(f"bench-{course.id}-{student}", course.id)
    pid = session["problem"]["id"]
    out = []
    for _ in range(problems):
        for message in _answers(course.problem[pid], student if varied else 0):
            turn = await service.start_turn(session["id"], message)
            events = {e["event"]: e async for e in turn}
            final, engage_ms = events["final"], events["engage"]["duration_ms"]
            steps = final["timing"]["steps"]
            out.append(
                TurnSample(
                    course=course.id,
                    student=student,
                    level=final["ladder_level"],
                    model_reply_used="explain" not in final["fallbacks"],
                    critical_path_ms=final["timing"]["critical_path_ms"],
                    sum_of_steps_ms=final["timing"]["sum_of_steps_ms"] + engage_ms,
                    steps_ms={n: s["end_ms"] - s["start_ms"] for n, s in steps.items()}
                    | {"engage": engage_ms},
                    reply=final["reply"],
                )
            )
            bar.update()
        if final["next_problem"] is None:
            break
        pid = final["next_problem"]["id"]
    return out


class _Greedy:
    """A chat model whose every call decodes greedily, whatever temperature the agent asks."""

    def __init__(self, llm: ChatLLM) -> None:
        self.llm, self.name = llm, llm.name

    def stream(self, messages: Messages, **kwargs: Any) -> AsyncIterator[str]:
        return self.llm.stream(messages, **(kwargs | {"temperature": 0.0}))


async def _run(
    model: str,
    students: int,
    problems: int,
    options: dict[str, Any],
    greedy: bool,
    max_concurrency: int | None,
    varied: bool,
) -> tuple[list[TurnSample], dict[str, float]]:
    config = EngineConfig.from_kwargs(model=model, **options)
    server = AsyncEngine(lambda: LLMEngine(config))
    tpots: list[float] = []

    def finished(out: RequestOutput) -> None:
        if (tpot := out.metrics.tpot) is not None:
            tpots.append(tpot)

    server.on_finished = finished
    await server.start()
    steps: list[StepRecord] = []
    server.engine.step_log = steps  # before any request: the engine thread reads it per step
    courses = load_courses()
    llm: ChatLLM = EngineLLM(server, model)
    with tempfile.TemporaryDirectory() as d:
        store = TutorStore(f"sqlite:///{d}/bench.db")
        service = TutorService(courses, store, _Greedy(llm) if greedy else llm)
        total = len(courses) * students * problems * 3
        sessions = asyncio.Semaphore(max_concurrency or len(courses) * students)
        in_flight = [0, 0]  # now, most

        async def student(course: Course, i: int, bar: tqdm) -> list[TurnSample]:
            async with sessions:
                in_flight[0] += 1
                in_flight[1] = max(in_flight)
                try:
                    return await _student(service, course, i, problems, varied, bar)
                finally:
                    in_flight[0] -= 1

        try:
            with tqdm(total=total, desc="tutor turns", unit="turn") as bar:
                runs = await asyncio.gather(
                    *(student(c, i, bar) for c in courses.values() for i in range(students))
                )
        finally:
            await service.close()
            await server.stop()
    kv, spec = server.engine.kv, server.engine.stats().spec
    counts = {
        "prompt_tokens": kv.prefix_query_tokens,
        "prefix_hit_tokens": kv.prefix_hit_tokens,
        # Cached blocks taken for other use: 0 means every prompt token computed was new to
        # the cache (not a prefix it had held and lost).
        "kv_evictions": kv.pool.num_evictions,
        "spec_draft_tokens": spec.num_draft_tokens,
        "spec_accepted_tokens": spec.num_accepted_tokens,
        "max_sessions_in_flight": in_flight[1],
        # Every model call's time per output token after its first (vLLM's mean TPOT).
        "model_calls": len(tpots),
        "mean_tpot_ms": 1000 * statistics.fmean(tpots) if tpots else 0.0,
    }
    for kind, group in _step_kinds(steps).items():
        counts[f"{kind}_steps"] = len(group)
        counts[f"{kind}_seconds"] = sum(r.step_s for r in group)
    # The engine's own time around the model (scheduling, drafting, bookkeeping): what a
    # proposer adds to a step that drafts nothing.
    counts["outside_forward_seconds"] = sum(r.step_s - r.forward_s for r in steps)
    return [s for run in runs for s in run], counts


def _step_kinds(steps: list[StepRecord]) -> dict[str, list[StepRecord]]:
    """The engine's steps by what they computed: some prompt ("prefill", decode rows beside it
    or not), decode rows with drafts to verify, decode rows alone."""
    kinds: dict[str, list[StepRecord]] = {"prefill": [], "verify": [], "decode": []}
    for r in steps:
        kinds["prefill" if r.prefills else "verify" if r.num_draft_tokens else "decode"].append(r)
    return kinds


def run_tutor_bench(
    model: str,
    students: int,
    problems: int,
    options: dict[str, Any],
    greedy: bool = False,
    max_concurrency: int | None = None,
    varied: bool = False,
) -> tuple[list[TurnSample], dict[str, float]]:
    """`greedy`: every agent decodes greedily, so that runs of different engine options compute
    the same replies and differ only in how fast. `varied`: each student of a class answers its
    own way (else all alike). `max_concurrency`: sessions in flight at once
    (none: every student of every course at once); the others wait their turn, course by course
    and student by student, so with 1 a class works through its problems one student after
    another, each after the classmates before it."""
    return asyncio.run(_run(model, students, problems, options, greedy, max_concurrency, varied))


def summary_table(samples: list[TurnSample]) -> str:
    rows = [
        "| rung | turns | model reply used | critical path, median ms | sum of steps, median ms "
        "| saved by the graph |",
        "|---|---|---|---|---|---|",
    ]
    names = {0: "0 confirmation", 1: "1 hint", 2: "2 guiding question", 3: "3 correction"}
    for level in sorted({s.level for s in samples}):
        group = [s for s in samples if s.level == level]
        crit = statistics.median(s.critical_path_ms for s in group)
        total = statistics.median(s.sum_of_steps_ms for s in group)
        used = sum(s.model_reply_used for s in group) / len(group)
        rows.append(
            f"| {names[level]} | {len(group)} | {used:.0%} | {crit:.0f} | {total:.0f} | "
            f"{1 - crit / total:.1%} |"
        )
    return "\n".join(rows)


def median_p90(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values), values[min(len(values) - 1, int(0.9 * len(values)))]


def step_table(samples: list[TurnSample]) -> str:
    rows = ["| step | median ms | p90 ms |", "|---|---|---|"]
    for step in (*CRITICAL_STEPS, "engage"):
        values = [s.steps_ms[step] for s in samples if step in s.steps_ms]
        if values:
            median, p90 = median_p90(values)
            rows.append(f"| {step} | {median:.0f} | {p90:.0f} |")
    return "\n".join(rows)


def plot(samples: list[TurnSample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for level, color in zip(range(4), ("#2e9d5b", "#2f6fde", "#d98a1c", "#8a1c1c"), strict=True):
        group = [s for s in samples if s.level == level]
        if group:
            left.scatter([s.sum_of_steps_ms / 1e3 for s in group],
                         [s.critical_path_ms / 1e3 for s in group],
                         s=14, color=color, label=f"rung {level}")  # fmt: skip
    top = max(s.sum_of_steps_ms for s in samples) / 1e3
    left.plot([0, top], [0, top], color="#999", lw=1, ls="--", label="no parallelism")
    left.set(xlabel="sum of all steps (s)", ylabel="critical path (s)", title="per turn")
    left.legend(fontsize=8)
    steps = [st for st in (*CRITICAL_STEPS, "engage") if any(st in s.steps_ms for s in samples)]
    medians = [statistics.median(s.steps_ms[st] for s in samples if st in s.steps_ms) / 1e3
               for st in steps]  # fmt: skip
    right.barh(steps[::-1], medians[::-1], color="#2f6fde")
    right.set(xlabel="median duration (s)", title="per agent (engage runs after the reply)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def as_json(samples: list[TurnSample], cache: dict[str, float]) -> dict[str, Any]:
    return {"turns": [asdict(s) for s in samples], "counters": cache}
