"""Tutoring at district scale: 4 → 64 simulated students per course, each scale feature on and off
(the reply cache, learner-state tiering, circuit breakers, hedged calls), with modelled model
endpoints.

The agents, prompts, ladder, guard, cache and routing are the real ones; only the model is a
stand-in (`modelled_endpoints.ModelledLLM`: real prompt token counts, modelled latencies).
Students answer each problem as in `bench tutor`: an authored misconception, another wrong
value, then the right answer.
"""

from __future__ import annotations

import asyncio
import io
import logging
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from tutorserve.bench.modelled_endpoints import LARGE, SMALL, ModelledLLM
from tutorserve.bench.tutor_turns import _answers
from tutorserve.config import EngineConfig
from tutorserve.engine.async_engine import AsyncEngine
from tutorserve.engine.engine import LLMEngine
from tutorserve.models.loader import load_tokenizer
from tutorserve.tutor.breaker import BreakerConfig
from tutorserve.tutor.courses import Course, load_courses
from tutorserve.tutor.hedge import HedgeConfig
from tutorserve.tutor.llm_client import ChatLLM, EngineLLM
from tutorserve.tutor.prompts import system_prompt
from tutorserve.tutor.reply_cache import ReplyCache
from tutorserve.tutor.routing import Routing
from tutorserve.tutor.service import TutorService
from tutorserve.tutor.store import TutorStore
from tutorserve.tutor.tiers import LearnerState, Tier, Uniform

log = logging.getLogger(__name__)
# Per-node timeouts well above a healthy call's modelled latency (queueing included), so only a
# hanging endpoint runs into them.
TIMEOUTS = {"diagnose": 8.0, "explain": 15.0, "engage": 8.0}


@dataclass(frozen=True, slots=True)
class Features:
    cache: bool = False
    tiering: bool = False
    breaker: bool = True
    hedge: bool = True  # a call late at the large model is also sent to the small one
    large_hangs: bool = False

    @property
    def label(self) -> str:
        on = [n for n in ("cache", "tiering") if getattr(self, n)]
        base = " + ".join(on) if on else "baseline (one large model, no cache)"
        if self.large_hangs:
            guard = ("breaker + hedge" if self.hedge else "breaker, no hedge") if self.breaker \
                else "no breaker"  # fmt: skip
            base += ", large model hanging, " + guard
        return base


@dataclass(slots=True)
class Result:
    features: Features
    students: int
    turns: int = 0
    solved: int = 0
    ladder: list[tuple[str, int, int]] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    steady_ms: list[float] = field(default_factory=list)  # each student's turns after problem 1
    prompt_tokens: int = 0
    generated_tokens: int = 0
    model_seconds: float = 0.0
    cache_hits: int = 0
    cache_lookups: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    breaker_opened: int = 0  # times any endpoint's breaker opened
    hedged: int = 0  # calls late at a model that were also sent a tier down
    hedges_won: int = 0  # of those, the ones the hedge answered first
    model_replies: int = 0  # turns whose reply text a model wrote (fresh or from the cache)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    def p(self, q: float, steady: bool = False) -> float:
        v = sorted(self.steady_ms if steady else self.latency_ms)
        return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


async def _student(service: TutorService, course: Course, i: int, problems: int, r: Result):
    s = await service.start_session(f"{course.id}-{i}", course.id, school=f"school-{i % 4}")
    pid = s["problem"]["id"]
    for n in range(problems):
        for message in _answers(course.problem[pid]):
            events = [e async for e in await service.start_turn(s["id"], message)]
            (final,) = [e for e in events if e["event"] == "final"]
            r.turns += 1
            r.solved += final["diagnosis"]["correct"]
            written = final["tiers"].get("explain") in ("small", "large", "cache")
            r.model_replies += written and "explain" not in final["fallbacks"]
            r.ladder.append((f"{course.id}/{i}/{pid}", r.turns, final["ladder_level"]))
            r.latency_ms.append(final["timing"]["critical_path_ms"])
            if n:
                r.steady_ms.append(final["timing"]["critical_path_ms"])
        if final["next_problem"] is None:
            break
        pid = final["next_problem"]["id"]


async def run_config(
    features: Features, students: int, problems: int, tokens: Any, engine: ChatLLM | None = None
) -> Result:
    """`engine`: a real model for both tiers instead of the modelled endpoints."""
    courses = load_courses()
    prefixes = {system_prompt(c): tokens((("system", system_prompt(c)),)) for c in courses.values()}
    small: ChatLLM = engine or ModelledLLM(SMALL, tokens, prefixes)
    large: ChatLLM = engine or ModelledLLM(
        replace(LARGE, hangs=features.large_hangs), tokens, prefixes
    )
    # A real CPU engine keeps the tutor's own timeouts and breaker settings. Without a
    # breaker: it never opens, and a call waits as long as its agent's timeout.
    timeouts = None if engine else TIMEOUTS
    if engine:
        breaker, hedge = BreakerConfig(), HedgeConfig()
    elif features.breaker:
        # Modelled calls take 0.1–3 s to a first token, queueing included: hedge after 1 s
        # until the large model's own first tokens say otherwise.
        breaker = BreakerConfig(slow_s=5.0)
        hedge = HedgeConfig(after_s=1.0) if features.hedge else None
    else:
        breaker, hedge = BreakerConfig(min_calls=10**9, slow_s=max(TIMEOUTS.values())), None
    routing = Routing(
        {Tier.SMALL: small if features.tiering else large, Tier.LARGE: large},
        LearnerState() if features.tiering else Uniform(),
        breaker,
        ReplyCache() if features.cache else None,
        hedge,
    )
    r = Result(features, students)
    with tempfile.TemporaryDirectory() as d:
        store = TutorStore(f"sqlite:///{d}/bench.db")
        service = TutorService(courses, store, routing, timeouts=timeouts)
        await asyncio.gather(*(_student(service, c, i, problems, r)
                               for c in courses.values() for i in range(students)))  # fmt: skip
        await service.close()
        spent = service.usage.totals("tier")
        r.prompt_tokens = sum(t.prompt_tokens for t in spent)
        r.generated_tokens = sum(t.generated_tokens for t in spent)
        r.model_seconds = sum(t.seconds for t in spent)
        r.by_tier = {t.key: t.tokens for t in spent if t.tokens}
    health = routing.health().values()
    r.breaker_opened = sum(b["times_opened"] for b in health)
    r.hedged = sum(b.get("hedged", 0) for b in health)
    r.hedges_won = sum(b.get("hedges_won", 0) for b in health)
    if routing.cache is not None:
        stats = routing.cache.stats()
        r.cache_hits = sum(stats["hits"].values())
        r.cache_lookups = r.cache_hits + sum(stats["misses"].values())
    r.ladder.sort()
    return r


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    return load_tokenizer("smollm2-135m-instruct")


def counter() -> Any:
    tok = _tokenizer()

    @lru_cache(maxsize=65536)
    def count(messages: tuple[tuple[str, str], ...]) -> int:
        return len(tok.encode_chat([{"role": r, "content": c} for r, c in messages]))

    return count


ENGINE_CONFIGS = (Features(), Features(cache=True, tiering=True))
CONFIGS = (
    Features(),
    Features(cache=True),
    Features(tiering=True),
    Features(cache=True, tiering=True),
    Features(cache=True, tiering=True, large_hangs=True, breaker=False, hedge=False),
    Features(cache=True, tiering=True, large_hangs=True, hedge=False),
    Features(cache=True, tiering=True, large_hangs=True),
)


def run_scale_bench(students: list[int], problems: int) -> list[Result]:
    tokens = counter()
    results = []
    for n in students:
        for features in CONFIGS:
            log.info("tutor scale: %d students per course, %s", n, features.label)
            results.append(asyncio.run(_bounded(run_config(features, n, problems, tokens))))
    return results


async def _bounded(run: Coroutine[Any, Any, Result], seconds: float = 900.0) -> Result:
    """`run`, or RuntimeError after `seconds` with every task's stack in the log: a modelled
    run takes a minute or two, so one that does not end is a bug to see, not a wait."""
    task = asyncio.create_task(run)
    done, _ = await asyncio.wait([task], timeout=seconds)
    if not done:
        stacks = io.StringIO()
        for t in asyncio.all_tasks() - {asyncio.current_task()}:
            t.print_stack(limit=12, file=stacks)
        log.error("a tutor-scale run did not end in %.0f s; its tasks:\n%s", seconds,
                  stacks.getvalue())  # fmt: skip
        task.cancel()
        raise RuntimeError(f"a tutor-scale run did not end in {seconds:.0f} s (tasks logged)")
    return task.result()


async def _on_engine(model: str, students: int, problems: int) -> list[Result]:
    server = AsyncEngine(lambda: LLMEngine(EngineConfig.from_kwargs(model=model)))
    await server.start()
    try:
        llm = EngineLLM(server, model)
        return [await run_config(f, students, problems, counter(), llm) for f in ENGINE_CONFIGS]
    finally:
        await server.stop()


def run_engine_bench(model: str, students: int, problems: int) -> list[Result]:
    """Baseline against cache + tiering on the real engine (one model serves both tiers, so
    tiering here only moves calls to authored text)."""
    return asyncio.run(_on_engine(model, students, problems))
