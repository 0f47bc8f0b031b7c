"""`ClusterFront`: the engine front (what `AsyncEngine` offers the server and the tutor) over
engine replicas on Ray Serve, so the same HTTP app serves one engine or a cluster.

Admission is decided here, before a request reaches Serve, with the single server's rules
(a waiting cap for the cluster and a per-user cap → 429); each call carries the prompt's chained
block hashes for the router. Prompts and structured-output grammars are checked here with the
model's tokenizer, so a bad request never reaches a replica. A background task asks every
replica for its stats every few seconds: each replica's snapshot for the metrics exporter (one
series per replica) and for `/health`, and the cluster's sum. The replica count may change
under us (autoscaling, restarts); the waiting cap follows the replicas that answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from tutorserve.cluster.adapters import AdapterRegistry
from tutorserve.cluster.failover import REPLICA_GONE, ReplicaCall, ResumingCall
from tutorserve.engine.async_engine import (
    AdmissionError,
    EngineDeadError,
    OutputStream,
    UserCaps,
)
from tutorserve.engine.engine import check_prompt
from tutorserve.engine.outputs import RequestOutput
from tutorserve.engine.stats import EngineStats
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.paging import extend_block_hashes
from tutorserve.sampling_params import SamplingParams, StructuredOutputs
from tutorserve.structured import GrammarCompiler

log = logging.getLogger(__name__)
_STATS_PERIOD_S = 2.0


class ClusterStream(OutputStream):
    """A request's outputs from its replica; closing before the end cancels the call, and the
    replica aborts the request."""

    def __init__(self, front: ClusterFront, request_id: str, user: str | None,
                 call: ReplicaCall, n: int) -> None:  # fmt: skip
        super().__init__(request_id, user)
        self._front, self._call = front, call
        self._open = n  # choices not yet finished

    @property
    def finished(self) -> bool:
        return self._open == 0

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out: RequestOutput = await self._call.__anext__()
        except StopAsyncIteration:
            raise EngineDeadError("the replica ended the request without a final output") from None
        except REPLICA_GONE as e:  # the replica died and the request could not go elsewhere
            raise EngineDeadError(f"the replica serving this request stopped: {e}") from e
        except Exception as e:  # Ray wraps what the replica raised; give the caller its cause
            raise replica_error(e) from e
        if out.finished:
            self._open -= 1
            self._front.on_finished(out)
        self._front._waiting.discard(self.request_id)
        return out

    def _on_close(self) -> None:
        self._front._release(self)
        if not self.finished:
            self._call.cancel()


class ClusterFront:
    def __init__(
        self,
        handle: DeploymentHandle,
        tokenizer: Tokenizer,
        *,
        adapters: AdapterRegistry,
        block_size: int,
        max_waiting: int = 256,
        max_requests_per_user: int | None = None,
        shutdown: Callable[[], None] = lambda: None,
    ) -> None:
        self.handle = handle
        # Every deployment of replicas, for broadcasts and stats (disaggregation adds one).
        self.handles = [handle]
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_waiting = max_waiting
        self.users = UserCaps(max_requests_per_user)
        self.on_finished: Callable[[RequestOutput], None] = lambda out: None
        self.on_rejected: Callable[[str], None] = lambda reason: None
        info = handle.info.remote().result()  # every replica serves the same model
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self._adapters: dict[str, str] = info["lora_adapters"]
        self._registry = adapters
        self._grammars = GrammarCompiler(tokenizer, self.vocab_size)
        self._shutdown = shutdown
        self._waiting: set[str] = set()  # submitted, no output yet
        self._stats = EngineStats.sum([])
        self._refresh: asyncio.Task | None = None
        # Replica id → (snapshot, adapter names, role: its deployment's name) of each that
        # answered the last stats round.
        self._replicas: dict[str, tuple[EngineStats, list[str], str]] = {}
        self._serve_states: dict[str, int] = {}
        self._serving = 0  # replicas among them that take requests
        self.resumed = 0  # calls sent again after their replica died

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._refresh = asyncio.create_task(self._refresh_stats())

    async def stop(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        await asyncio.to_thread(self._shutdown)

    @property
    def healthy(self) -> bool:
        """Some replica answered the last stats round (Serve restarts the ones that die)."""
        return bool(self._replicas)

    # ---- model info -------------------------------------------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        check_prompt(ids, self.max_model_len, self.vocab_size)

    def check_structured(self, spec: StructuredOutputs) -> None:
        self._grammars.matcher(spec)

    def lora_adapters(self) -> dict[str, str]:
        return dict(self._adapters)

    async def load_lora(self, name: str, path: str) -> None:
        """Registered before the broadcast, so a replica starting meanwhile loads it too."""
        if name in self._adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        await self._registry.add(name, path)
        try:
            await self._every_replica("load_lora", name, path)
        except BaseException:
            await self._registry.remove(name)  # new replicas must not fail on what these refused
            raise
        self._adapters[name] = path

    async def unload_lora(self, name: str) -> None:
        await self._every_replica("unload_lora", name)
        await self._registry.remove(name)
        self._adapters.pop(name, None)

    async def _every_replica(self, method: str, *args: Any) -> None:
        results = await self._broadcast(method, *args, timeout_s=120)
        errors = [replica_error(r) for _, r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def _broadcast(self, method: str, *args: Any, timeout_s: float) -> list[tuple[str, Any]]:
        """Every replica's answer, or what it raised, over every deployment, with the
        deployment's name (its replicas' role: "engine", or "prefill" / "decode")."""
        answers = await asyncio.gather(*(
            h.broadcast(method, *args).results_async(timeout_s=timeout_s, return_exceptions=True)
            for h in self.handles
        ))  # fmt: skip
        return [(h.deployment_name, r) for h, got in zip(self.handles, answers, strict=True)
                for r in got]  # fmt: skip

    def stats(self) -> EngineStats:
        return replace(self._stats, num_waiting=self._stats.num_waiting + len(self._waiting))

    def replica_stats(self) -> dict[tuple[str, str], EngineStats]:
        """Each replica's snapshot (of those that answered the last round), by (replica id,
        role)."""
        return {(rid, role): stats for rid, (stats, _, role) in self._replicas.items()}

    def health(self) -> dict[str, Any]:
        """Each replica that answered the last stats round, and Serve's count of the
        deployment's replicas by state (those starting or stopping included)."""
        return {
            "replicas": {
                rid: {
                    "role": role,
                    "running": s.num_running,
                    "waiting": s.num_waiting,
                    "adapters": names,
                }
                for rid, (s, names, role) in sorted(self._replicas.items())
            },
            "serve_replica_states": dict(self._serve_states),
            "resumed_requests": self.resumed,
        }

    async def _refresh_stats(self) -> None:
        while True:
            try:
                got = await self._broadcast("stats", timeout_s=10)
                # A replica that raised is left out: it is dying, and Serve replaces it.
                answered = [(role, r) for role, r in got if isinstance(r, tuple)]
                self._replicas = {rid: (s, names, role) for role, (rid, s, names) in answered}
                self._stats = EngineStats.sum([s for s, _, _ in self._replicas.values()])
                # The waiting cap counts the replicas that take requests (not prefill ones).
                self._serving = sum(role == self.handle.deployment_name for role, _ in answered)
                self._serve_states = await asyncio.to_thread(self._replica_states)
            except Exception:  # a replica restarting: keep the last snapshot
                log.debug("cluster stats not refreshed", exc_info=True)
            await asyncio.sleep(_STATS_PERIOD_S)

    def _replica_states(self) -> dict[str, int]:
        apps, states = serve.status().applications, Counter[str]()
        for h in self.handles:
            states.update(apps[h.app_name].deployments[h.deployment_name].replica_states)
        return dict(states)

    # ---- requests -----------------------------------------------------------------------------
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
    ) -> ClusterStream:
        """Queue a validated request on the replica the router picks, or raise
        AdmissionError if the cluster is full."""
        try:
            self.users.check(user, 1)
        except AdmissionError:
            self.on_rejected("user_limit")
            raise
        if len(self._waiting) >= self.max_waiting * max(1, self._serving):
            self.on_rejected("queue_full")
            raise AdmissionError(
                f"the cluster is at capacity ({len(self._waiting)} requests waiting)", 1
            )
        options = dict(priority=priority, session_id=session_id, lora=lora,
                       spec_scope=spec_scope, n=n)  # fmt: skip

        def make_call(attempt: int, ids: list[int], p: SamplingParams) -> ReplicaCall:
            # A later attempt's id differs, in case the replica that had it is still alive.
            rid = request_id if attempt == 0 else f"{request_id}~{attempt}"
            return self._call(rid, ids, p, **options)

        call = ResumingCall(request_id, prompt_ids, params, n, make_call, self.tokenizer,
                            on_resume=self._count_resumed)  # fmt: skip
        self.users.add(user)
        self._waiting.add(request_id)
        return ClusterStream(self, request_id, user, call, n)

    def _call(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
              **options: Any) -> ReplicaCall:  # fmt: skip
        """The request's streaming call to the replica the router picks."""
        return self.handle.options(stream=True).generate.remote(
            request_id, prompt_ids, params, block_hashes=self.block_hashes(prompt_ids), **options
        )

    def block_hashes(self, ids: list[int]) -> list[bytes]:
        """The chained hashes of the prompt's full blocks, as the engine's prefix cache keys
        them (base model; an adapter's salt is the router's `lora` fact instead)."""
        return extend_block_hashes([], ids, self.block_size)

    def _count_resumed(self) -> None:
        self.resumed += 1

    def _release(self, stream: ClusterStream) -> None:
        self._waiting.discard(stream.request_id)
        self.users.release(stream._user)


def replica_error(error: BaseException) -> BaseException:
    """What a replica raised, out of Ray's wrapping."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error
