"""The engine's step loop on its own thread, bridged to asyncio, with admission control.

HTTP handlers live on the event loop; the model forward must not, or one long prefill would stall
every stream. One thread owns the `LLMEngine` from its construction on: it takes new requests and
aborts from an inbox under a lock, steps without the lock, and hands each step's outputs back to
the loop in a single `call_soon_threadsafe`.

The engine is built on that thread too (`make_engine`), not handed over built. Loading runs
PyTorch ops, and a thread's first parallel op gives it an OpenMP team of its own; once the process
holds more OpenMP threads than cores, libgomp stops spinning between parallel regions and puts
threads to sleep instead, and each of a decode step's ~200 regions then waits for a wake-up. A
model loaded on the main thread and stepped on this one decoded at batch 1 more than twice as
slowly (`bench/engine_thread.py`; docs/benchmarks/quantization.md).

Admission (waiting-queue cap, per-user cap) is decided on the loop before a request reaches the
inbox, so a refused request costs nothing but its parse.

This is the engine's front for the server and the tutor: submit (a stream out; closing it
aborts), model info (tokenizer, context length, prompt checks, LoRA adapters) and a stats
snapshot; what a metrics exporter counts arrives through `on_finished` and `on_rejected`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from tutorserve.engine.engine import LLMEngine
from tutorserve.engine.outputs import RequestOutput
from tutorserve.engine.stats import EngineStats
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.sampling_params import SamplingParams, StructuredOutputs

log = logging.getLogger(__name__)
T = TypeVar("T")


class AdmissionError(Exception):
    """The server is full for now (HTTP 429): the client should retry after `retry_after` s."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UserCaps:
    """Requests in flight per `user`, against an optional cap: past it, AdmissionError."""

    def __init__(self, cap: int | None) -> None:
        if cap is not None and cap < 1:
            raise ValueError("max_requests_per_user must be at least 1")
        self.cap = cap
        self._counts: Counter[str] = Counter()

    def check(self, user: str | None, retry_after: int) -> None:
        if user is not None and self.cap is not None and self._counts[user] >= self.cap:
            raise AdmissionError(
                f"user {user!r} already has {self._counts[user]} requests in flight "
                f"(the limit is {self.cap})",
                retry_after,
            )

    def add(self, user: str | None) -> None:
        if user is not None:
            self._counts[user] += 1

    def release(self, user: str | None) -> None:
        if user is not None:
            self._counts[user] -= 1
            if self._counts[user] <= 0:
                del self._counts[user]


class EngineDeadError(RuntimeError):
    """The step loop stopped on an internal error; requests in flight cannot finish."""


@dataclass(slots=True)
class _Pending:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    session_id: str | None
    lora: str | None
    spec_scope: str | None


class OutputStream(ABC):
    """What an engine front's `submit` returns: one request's outputs, in order; `close()` (or
    leaving `async with`) before the final output aborts the request and frees its KV blocks.
    Closing twice is closing once."""

    def __init__(self, request_id: str, user: str | None) -> None:
        self.request_id = request_id
        self._user = user
        self._closed = False

    @property
    @abstractmethod
    def finished(self) -> bool:
        """Every choice has given its final output."""

    @abstractmethod
    async def __anext__(self) -> RequestOutput: ...

    @abstractmethod
    def _on_close(self) -> None:
        """Give back what the request holds in the front, and abort it if it is unfinished."""

    def __aiter__(self) -> OutputStream:
        return self

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close()


class RequestStream(OutputStream):
    """An `AsyncEngine` request's outputs.

    A request for `n` choices runs as n engine requests: choice 0 under the request's id, choice
    i under `id#i`, each output tagged with its `index`; the stream ends when all have."""

    def __init__(self, engine: AsyncEngine, request_id: str, user: str | None, n: int) -> None:
        super().__init__(request_id, user)
        self.choice_ids = [request_id, *(f"{request_id}#{i}" for i in range(1, n))]
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._open = set(self.choice_ids)
        # Choices 1..n-1, submitted once choice 0 has computed the prompt (see AsyncEngine._fork).
        self._forks: list[_Pending] = []

    @property
    def finished(self) -> bool:
        return not self._open

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._open.discard(item.request_id)
        return item

    def _on_close(self) -> None:
        self._engine._release(self)


class AsyncEngine:
    """`make_engine` runs on the engine's own thread; the constructor returns once it has (and
    raises what it raised). Steps begin at `start()`."""

    def __init__(
        self,
        make_engine: Callable[[], LLMEngine],
        *,
        max_waiting: int = 256,
        max_requests_per_user: int | None = None,
    ) -> None:
        if max_waiting < 1:
            raise ValueError("max_waiting must be at least 1")
        self.max_waiting = max_waiting
        self.users = UserCaps(max_requests_per_user)
        # Called on the event loop: each ended request, and each refusal by its reason
        # ("queue_full", "user_limit"). A metrics exporter sets them.
        self.on_finished: Callable[[RequestOutput], None] = lambda out: None
        self.on_rejected: Callable[[str], None] = lambda reason: None
        self._cond = threading.Condition()
        self._adds: list[_Pending] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._recent_latency = 1.0  # seconds; an EMA behind Retry-After
        self.error: BaseException | None = None
        built: queue.SimpleQueue[LLMEngine | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._own, args=(make_engine, built), name="engine-loop", daemon=True
        )
        self._thread.start()
        engine = built.get()
        if isinstance(engine, BaseException):
            self._thread.join()
            raise engine
        self.engine = engine

    # ---- lifecycle (called on the event loop) -------------------------------------------
    async def start(self) -> None:
        with self._cond:
            self._loop = asyncio.get_running_loop()
            self._cond.notify()

    async def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self.engine.close)
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # ---- model info and state (read on the event loop) ---------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_prompt(self, ids: list[int]) -> None:
        """ValueError for a prompt the engine cannot take (empty, too long, bad token ids)."""
        self.engine.check_prompt(ids)

    @property
    def vocab_size(self) -> int:
        """Token ids run over [0, vocab_size) (the model's, which may exceed the tokenizer's)."""
        return self.engine.model.config.vocab_size

    def check_structured(self, spec: StructuredOutputs) -> None:
        """ValueError naming the problem if `spec` does not compile. Compiling caches it, so
        the engine thread finds it ready; call it off the event loop (it may take ms)."""
        self.engine.grammars.matcher(spec)

    def lora_adapters(self) -> dict[str, str]:
        """Registered LoRA adapters: name → folder."""
        return {name: str(self.engine.lora.paths[name]) for name in self.engine.lora_names()}

    async def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter (ValueError if invalid or the name is taken)."""
        await self.call(lambda: self.engine.load_lora(name, path))

    async def unload_lora(self, name: str) -> None:
        """KeyError if unknown, ValueError while requests use it."""
        await self.call(lambda: self.engine.unload_lora(name))

    @property
    def num_waiting(self) -> int:
        # len() of a list the engine thread mutates is an atomic snapshot under the GIL.
        return len(self._adds) + len(self.engine.scheduler.waiting)

    def stats(self) -> EngineStats:
        """The engine's snapshot, requests still in this front's inbox counted as waiting."""
        return replace(self.engine.stats(), num_waiting=self.num_waiting)

    # ---- requests (called on the event loop) --------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        user: str | None = None,
        session_id: str | None = None,
        lora: str | None = None,
        spec_scope: str | None = None,
        n: int = 1,
    ) -> RequestStream:
        """Queue a validated request for `n` choices, or raise AdmissionError if the server is
        full. With a seed, choice i samples with seed + i (vLLM's rule), so choices differ."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        retry = max(1, round(self._recent_latency))
        try:
            self.users.check(user, retry)
        except AdmissionError:
            self.on_rejected("user_limit")
            raise
        with self._cond:
            if self.num_waiting >= self.max_waiting:
                self.on_rejected("queue_full")
                raise AdmissionError(
                    f"the server is at capacity ({self.num_waiting} requests waiting)", retry
                )
            stream = RequestStream(self, request_id, user, n)
            pending = [
                _Pending(cid, prompt_ids, _choice_params(params, i), priority, session_id,
                         lora, spec_scope)
                for i, cid in enumerate(stream.choice_ids)
            ]  # fmt: skip
            for cid in stream.choice_ids:
                self._streams[cid] = stream
            self.users.add(user)
            self._adds.append(pending[0])
            stream._forks = pending[1:]
            self._cond.notify()
        return stream

    def _fork(self, stream: RequestStream) -> None:
        """Submit a request's other choices. They wait for choice 0's first output: its prompt
        blocks are in the prefix cache by then, so every choice shares them and computes only
        the prompt's last partial block (a request that was accepted is not refused now)."""
        with self._cond:
            self._adds.extend(stream._forks)
            self._cond.notify()
        stream._forks = []

    def _release(self, stream: RequestStream) -> None:
        for cid in stream.choice_ids:
            self._streams.pop(cid, None)
        self.users.release(stream._user)
        stream._forks = []
        live = stream._open
        if not live:
            return
        with self._cond:
            queued = {p.request_id for p in self._adds if p.request_id in live}
            self._adds[:] = [p for p in self._adds if p.request_id not in queued]
            self._aborts.extend(live - queued)
            self._cond.notify()

    # ---- the engine thread ----------------------------------------------------------------
    def _own(self, make_engine: Callable[[], LLMEngine], built: queue.SimpleQueue) -> None:
        try:
            engine = make_engine()
        except BaseException as e:  # raised again by the constructor, on its thread
            built.put(e)
            return
        built.put(engine)
        with self._cond:
            while self._loop is None and not self._stopping:
                self._cond.wait()
        if not self._stopping:
            self._run(engine)

    def _run(self, engine: LLMEngine) -> None:
        try:
            while True:
                with self._cond:
                    idle = False
                    while not (
                        self._stopping
                        or self._adds
                        or self._aborts
                        or self._calls
                        or engine.has_unfinished()
                    ):
                        if not idle:
                            engine.on_idle()
                            idle = True
                        self._cond.wait()
                    if self._stopping:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                    # Inside the lock so a request is always counted as waiting somewhere.
                    refused = [(p.request_id, e) for p in adds if (e := self._add(p))]
                for fn, future in calls:
                    self._answer(future, fn)
                outputs = [out for rid in aborts if (out := engine.abort_request(rid))]
                outputs += engine.step()
                if outputs or refused:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs, refused)
        except BaseException as e:
            log.exception("engine loop stopped")
            self.error = e
            self._loop.call_soon_threadsafe(
                self._fail_all, EngineDeadError(f"engine loop stopped: {e!r}")
            )

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two steps (it owns the engine: loading an
        adapter while a step runs would change weights under it); its exception is raised here."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify()
        return await future

    def _answer(self, future: asyncio.Future, fn: Callable[[], Any]) -> None:
        try:
            result, error = fn(), None
        except Exception as e:  # handed to the caller, whatever it is
            result, error = None, e

        def settle() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        self._loop.call_soon_threadsafe(settle)

    def _add(self, p: _Pending) -> ValueError | None:
        try:
            self.engine.add_request(
                p.request_id,
                p.prompt_ids,
                p.params,
                priority=p.priority,
                session_id=p.session_id,
                lora=p.lora,
                spec_scope=p.spec_scope,
            )
        except ValueError as e:  # validated on the loop already; kept so one request can't kill
            return e
        return None

    def _dispatch(
        self, outputs: list[RequestOutput], refused: list[tuple[str, ValueError]]
    ) -> None:
        for request_id, error in refused:
            if (stream := self._streams.get(request_id)) is not None:
                stream._queue.put_nowait(error)
        for out in outputs:
            if out.finished:
                self.on_finished(out)
                if (e2e := out.metrics.e2e_latency) is not None:
                    self._recent_latency = 0.9 * self._recent_latency + 0.1 * e2e
            stream = self._streams.get(out.request_id)
            if stream is not None:
                out.index = stream.choice_ids.index(out.request_id)
                stream._queue.put_nowait(out)
                if stream._forks:
                    self._fork(stream)

    def _fail_all(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream._queue.put_nowait(error)


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + index)
