"""Prefill/decode disaggregation: prompts are computed on prefill replicas, and decode replicas
continue the requests from the prompts' KV blocks.

The blocks move by block hash through the disk tier's folder, which every replica shares: a
prefill replica computes the prompt (one greedy token, discarded), keeps its full blocks as a
session's are kept, so they are written through to disk, and answers once they are there (the
KV store's `wait_written`). The request then goes to the decode replica the routing policy
picks, whose prefix lookup misses its pool, finds the blocks in the shared folder and restores
them: it computes only the prompt's last, partial block and decodes. What this costs is a disk
write and a read of the prompt's blocks; what it buys is that a long prompt is computed where it
does not stall the decode steps of the requests already running.

If the prefill call fails or times out, the request goes to a decode replica anyway, which then
computes the prompt itself: slower, but the same tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ray.serve.handle import DeploymentHandle

from tutorserve.cluster.failover import ReplicaCall
from tutorserve.cluster.front import ClusterFront, replica_error
from tutorserve.engine.outputs import RequestOutput
from tutorserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
# A prefill waits in its replica's queue and for its disk writes (30 s at most, replica.py);
# past this the decode replica computes the prompt instead.
PREFILL_TIMEOUT_S = 120.0


class PrefillCall(Protocol):
    """A prefill replica's answer on its way (Serve's `DeploymentResponse`)."""

    def __await__(self) -> Any: ...

    def cancel(self) -> None: ...


class PrefillThenDecode:
    """A request's call: first the prefill (awaited on the first read), then the streaming
    call to a decode replica, started only once the prompt's blocks are on disk."""

    def __init__(self, request_id: str, prefill: PrefillCall,
                 decode: Callable[[], ReplicaCall], timeout_s: float) -> None:  # fmt: skip
        self.request_id = request_id
        self._prefill, self._decode, self._timeout_s = prefill, decode, timeout_s
        self._call: ReplicaCall | None = None
        self._cancelled = False
        self.prefilled = False  # the prefill replica's blocks are on disk for the decode

    async def __anext__(self) -> RequestOutput:
        if self._call is None:
            await self._handoff()
            if self._cancelled:  # the client left while the prompt was computed
                raise StopAsyncIteration
            self._call = self._decode()
        return await self._call.__anext__()

    async def _handoff(self) -> None:
        try:
            blocks = await asyncio.wait_for(_awaited(self._prefill), self._timeout_s)
        except Exception as e:  # Ray's wrapping, a dead replica, a timeout: decode computes it
            self._prefill.cancel()
            if self._cancelled:  # the client left: nothing failed
                return
            log.warning("prefill of %s failed (%r): its decode replica computes the prompt",
                        self.request_id, replica_error(e))  # fmt: skip
            return
        self.prefilled = True
        log.debug("prefill of %s: %d blocks on disk", self.request_id, blocks)

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is None:
            self._prefill.cancel()
        else:
            self._call.cancel()


async def _awaited(call: Awaitable[int]) -> int:
    return await call


class DisaggFront(ClusterFront):
    """`ClusterFront` over decode replicas (its `handle`) with prefill replicas before them;
    broadcasts (adapters) and stats cover both deployments."""

    def __init__(self, decode: DeploymentHandle, prefill: DeploymentHandle, *args: Any,
                 prefill_timeout_s: float = PREFILL_TIMEOUT_S, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(decode, *args, **kwargs)
        self.prefill = prefill
        self.handles.append(prefill)
        self.prefill_timeout_s = prefill_timeout_s

    def _call(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
              **options: Any) -> ReplicaCall:  # fmt: skip
        def decode() -> ReplicaCall:
            return ClusterFront._call(self, request_id, prompt_ids, params, **options)

        if not self.wants_prefill(prompt_ids, params):
            return decode()
        prefill = self.prefill.prefill.remote(
            request_id, prompt_ids, session_id=options.get("session_id"),
            lora=options.get("lora"), block_hashes=self.block_hashes(prompt_ids),
        )  # fmt: skip
        return PrefillThenDecode(request_id, prefill, decode, self.prefill_timeout_s)

    def wants_prefill(self, prompt_ids: list[int], params: SamplingParams) -> bool:
        """Whether the decode replica could take any of the prompt's blocks from a prefill: it
        computes at least the last prompt token itself, and all of a prompt whose
        log-probabilities were asked for."""
        return params.prompt_logprobs is None and (len(prompt_ids) - 1) // self.block_size > 0
