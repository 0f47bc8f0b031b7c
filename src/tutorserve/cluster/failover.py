"""A request outlives its replica: when the replica serving a call dies, the call goes again to
another one, and a stream that had begun continues there with the same tokens.

A call that had produced nothing is simply sent again (Serve's router has dropped the dead
replica by then, or drops it on the next try). A stream that had produced tokens continues as a
new request whose prompt is the old prompt plus every token generated so far, asking for the
tokens still owed; its outputs are stitched onto the earlier ones (the same request id, prompt,
token ids, text and metrics the client would have seen from one replica). Greedy output is
therefore the same as without the failure. The continuation recomputes the prompt and the
generated tokens on its replica; a session's earlier turns come from the shared disk tier.

Only requests whose output does not depend on where the output began are continued: one choice,
no stop strings (one could straddle the seam), no structured output (its grammar state lives on
the dead replica), no presence or frequency penalty (they count output tokens only). Any other
request that had started streaming ends with an error, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from tutorserve.engine.detokenizer import IncrementalDetokenizer
from tutorserve.engine.outputs import RequestMetrics, RequestOutput
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
# Serve notices a dead replica within seconds; past this the request fails rather than wait on.
RESUME_DEADLINE_S = 60.0
_FIRST_BACKOFF_S = 0.25
# What a call raises when its replica is gone (died, or Serve gave up on it).
REPLICA_GONE = (RayActorError, ReplicaUnavailableError)


class ReplicaCall(Protocol):
    """A streaming call to a replica: Serve's response generator, or one made of several calls
    (`disagg.py`, and `ResumingCall` here)."""

    async def __anext__(self) -> RequestOutput: ...

    def cancel(self) -> None: ...


def continuable(params: SamplingParams, n: int) -> bool:
    """Whether a stream that has produced tokens can continue on another replica unchanged."""
    return (n == 1 and not params.stop and params.structured is None
            and params.presence_penalty == 0 and params.frequency_penalty == 0)  # fmt: skip


class ResumingCall:
    """A replica call that goes to another replica when its own dies. `make_call(attempt,
    prompt_ids, params)` makes each call: attempt 0 is the request as it came."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        make_call: Callable[[int, list[int], SamplingParams], ReplicaCall],
        tokenizer: Tokenizer,
        on_resume: Callable[[], None] = lambda: None,
    ) -> None:
        self.request_id = request_id
        self._prompt, self._params, self._n = prompt_ids, params, n
        self._make_call, self._tokenizer, self._on_resume = make_call, tokenizer, on_resume
        self._attempt = 0
        self._call = make_call(0, prompt_ids, params)
        self._cancelled = False
        self._last: RequestOutput | None = None  # what the client has seen, stitched
        self._before: RequestOutput | None = None  # the same, when the current call began
        self._detok: IncrementalDetokenizer | None = None  # text across the seam

    async def __anext__(self) -> RequestOutput:
        deadline = time.monotonic() + RESUME_DEADLINE_S
        while True:
            try:
                out = await self._call.__anext__()
            except REPLICA_GONE as e:
                if self._cancelled or not self._may_resume() or time.monotonic() > deadline:
                    raise
                await self._resume(e)
                continue
            self._last = self._stitched(out)
            return self._last

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def _may_resume(self) -> bool:
        done = self._last
        return done is None or (continuable(self._params, self._n)
                                and len(done.token_ids) < self._params.max_tokens)  # fmt: skip

    async def _resume(self, error: Exception) -> None:
        await asyncio.sleep(_FIRST_BACKOFF_S * 2 ** min(self._attempt, 4))
        self._attempt += 1
        self._on_resume()
        done = self._last
        if done is None:  # nothing was sent to the client: the same request again
            log.warning("replica died before %s started (%s): sending it again",
                        self.request_id, type(error).__name__)  # fmt: skip
            self._call = self._make_call(self._attempt, self._prompt, self._params)
            return
        made = len(done.token_ids)
        log.warning("replica died %d tokens into %s (%s): continuing it elsewhere",
                    made, self.request_id, type(error).__name__)  # fmt: skip
        p = self._params
        params = replace(p, max_tokens=p.max_tokens - made, prompt_logprobs=None,
                         min_tokens=max(0, p.min_tokens - made))  # fmt: skip
        self._before = done
        self._detok = IncrementalDetokenizer(self._tokenizer, self._params.skip_special_tokens)
        for t in done.token_ids:
            self._detok.add(t)
        self._call = self._make_call(self._attempt, self._prompt + done.token_ids, params)

    def _stitched(self, out: RequestOutput) -> RequestOutput:
        """`out` of the current call as the client expects it from the request's first call."""
        before = self._before
        if before is None:  # the first call, or one sent again before anything came back
            return out if self._attempt == 0 else replace(out, request_id=self.request_id)
        assert self._detok is not None
        fed = len(self._detok.ids) - len(before.token_ids)  # of this call's tokens
        for t in out.token_ids[fed:]:
            self._detok.add(t)
        prior = self._last  # set since the resume: `before` is what it was then
        assert prior is not None
        m, b = out.metrics, before.metrics
        return replace(
            out,
            request_id=self.request_id,
            prompt=before.prompt,
            prompt_token_ids=before.prompt_token_ids,
            text=self._detok.text,
            token_ids=before.token_ids + out.token_ids,
            delta_text=self._detok.text[len(prior.text) :],
            logprobs=None if out.logprobs is None else (before.logprobs or []) + out.logprobs,
            prompt_logprobs=before.prompt_logprobs,
            index=before.index,
            metrics=RequestMetrics(
                arrival_time=b.arrival_time,
                first_token_time=b.first_token_time or m.first_token_time,
                finish_time=m.finish_time,
                num_prompt_tokens=b.num_prompt_tokens,
                num_cached_tokens=b.num_cached_tokens,
                num_output_tokens=b.num_output_tokens + m.num_output_tokens,
                num_preemptions=b.num_preemptions + m.num_preemptions,
            ),
        )
