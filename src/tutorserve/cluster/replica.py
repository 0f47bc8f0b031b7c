"""One engine on a Ray Serve replica: the same `AsyncEngine` a single server runs (its own
engine thread, one OpenMP team), reached through Serve's handle calls. Admission is decided at
the ingress (`ClusterFront`), so a replica queues whatever Serve routes to it. A replica loads
the adapters registered at run time (`adapters.py`) before its engine takes a request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from tutorserve.cluster.adapters import registered_adapters
from tutorserve.config import EngineConfig
from tutorserve.engine.async_engine import AsyncEngine
from tutorserve.engine.engine import LLMEngine
from tutorserve.engine.outputs import RequestOutput
from tutorserve.engine.stats import EngineStats
from tutorserve.paging import extend_block_hashes
from tutorserve.sampling_params import SamplingParams

_UNBOUNDED = 1 << 30
# How long a prefill replica waits for a prompt's blocks to reach the shared folder.
_HANDOFF_WRITE_TIMEOUT_S = 30.0


class EngineReplica:
    def __init__(self, engine_options: dict[str, Any]) -> None:
        # Replicas share the disk tier's folder: a session's KV goes to disk as each turn ends,
        # so if this replica dies another one resumes the session from there.
        config = EngineConfig.from_kwargs(**engine_options | {"session_write_through": True})
        self._registered = registered_adapters()

        def build() -> LLMEngine:
            engine = LLMEngine(config)
            for name, path in self._registered.items():
                engine.load_lora(name, path)
            return engine

        self.server = AsyncEngine(build, max_waiting=_UNBOUNDED)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._started = False

    async def _start(self) -> None:
        if not self._started:  # the engine loop needs the replica's event loop
            await self.server.start()
            self._started = True

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        session_id: str | None = None,
        lora: str | None = None,
        spec_scope: str | None = None,
        n: int = 1,
        block_hashes: list[bytes] | None = None,  # read by the router, not here
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine gives them; cancelling the call (the client
        left) aborts the request and frees its KV blocks."""
        await self._start()
        stream = self.server.submit(request_id, prompt_ids, params, priority=priority,
                                    session_id=session_id, lora=lora, spec_scope=spec_scope,
                                    n=n)  # fmt: skip
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        *,
        session_id: str | None = None,
        lora: str | None = None,
        block_hashes: list[bytes] | None = None,  # read by the router, not here
    ) -> int:
        """Compute the prompt (one greedy token, discarded) and return once its full blocks are
        in the shared disk folder, so a decode replica finds them by block hash; the number of
        blocks written. Kept as a session's blocks are (that is what writes them through), under
        its own id when the request has none; the pool keeps none of them held."""
        await self._start()
        engine = self.server.engine
        if engine.store is None or engine.store.disk is None:
            raise RuntimeError("prefill replicas need the shared disk tier (--kv-disk-dir)")
        stream = self.server.submit(request_id, prompt_ids,
                                    SamplingParams(max_tokens=1, temperature=0),
                                    session_id=session_id or f"prefill:{request_id}",
                                    lora=lora)  # fmt: skip
        try:
            async for out in stream:
                if out.finished and out.finish_reason == "abort":
                    raise RuntimeError(f"the prefill of {request_id} was aborted")
        finally:
            stream.close()
        keys = extend_block_hashes([], prompt_ids, engine.config.block_size,
                                   engine.check_lora(lora))  # fmt: skip
        written = await asyncio.to_thread(engine.store.wait_written, keys, _HANDOFF_WRITE_TIMEOUT_S)
        if not written:
            raise RuntimeError(f"the prefill of {request_id}: blocks not on disk in time")
        return len(keys)

    async def info(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "max_model_len": self.server.max_model_len,
            "vocab_size": self.server.vocab_size,
            "lora_adapters": self.server.lora_adapters(),
        }

    async def stats(self) -> tuple[str, EngineStats, list[str]]:
        """This replica's id, engine snapshot and adapter names."""
        return self.replica, self.server.stats(), sorted(self.server.lora_adapters())

    async def load_lora(self, name: str, path: str) -> None:
        await self._start()
        # A replica that started between the registry's entry and the broadcast has it already.
        if self._registered.get(name) == path and name in self.server.lora_adapters():
            return
        await self.server.load_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        await self._start()
        await self.server.unload_lora(name)

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router weighs besides its own counts: the adapters in compute slots."""
        lora = self.server.engine.lora
        return {"adapters": [] if lora is None else [a for a in lora.slots if a is not None]}

    def check_health(self) -> None:
        """Serve restarts a replica whose engine loop died."""
        if self._started and not self.server.healthy:
            raise RuntimeError(f"the engine loop stopped: {self.server.error!r}")
