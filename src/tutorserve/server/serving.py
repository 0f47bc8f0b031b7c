"""From a validated OpenAI request to engine work and back: prompt, limits, JSON or SSE.

The request is checked against the model (name, context length) before admission, so a bad
request never takes a queue slot. Streams are Server-Sent Events ending in `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tutorserve.engine.async_engine import AsyncEngine, RequestStream
from tutorserve.engine.outputs import RequestOutput
from tutorserve.sampling_params import SamplingParams
from tutorserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
    chunk,
    error_body,
)


class APIError(Exception):
    """A client error with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict:
        return error_body(str(self), self.type, self.param, self.code)


class OpenAIServing:
    def __init__(self, server: AsyncEngine, model_name: str) -> None:
        self.server = server
        self.model_name = model_name
        self.tokenizer = server.tokenizer
        self.max_model_len = server.max_model_len

    # ---- building the engine request --------------------------------------------------------
    def _check_model(self, model: str) -> str | None:
        """The LoRA adapter that `model` names, or None for the base model."""
        if model == self.model_name:
            return None
        adapters = list(self.server.lora_adapters())
        if model in adapters:
            return model
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{self.model_name}`"
            + (f" and the LoRA adapters {adapters}." if adapters else "."),
            param="model",
            code="model_not_found",
        )  # fmt: skip

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise APIError(
                400, "this model has no chat template; use /v1/completions", param="messages"
            )
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in req.messages
        ]
        return self._checked(self.tokenizer.encode_chat(messages), "messages")

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        ids = self.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
        return self._checked(ids, "prompt")

    def _checked(self, ids: list[int], param: str) -> list[int]:
        """The engine's own prompt check, as a 400 naming the field."""
        try:
            self.server.check_prompt(ids)
        except ValueError as e:
            code = "context_length_exceeded" if len(ids) >= self.max_model_len else None
            raise APIError(400, str(e), param=param, code=code) from e
        return ids

    def sampling_params(
        self, req: ChatCompletionRequest | CompletionRequest, num_prompt: int
    ) -> SamplingParams:
        room = self.max_model_len - num_prompt
        limit = req.output_limit
        if limit is not None and limit > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {num_prompt}, so at most {room} can be generated, but "
                f"{limit} were requested.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_tokens=limit or room,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
        )

    # ---- running it ---------------------------------------------------------------------------
    async def create(
        self, req: ChatCompletionRequest | CompletionRequest, request: Request
    ) -> Response:
        chat = isinstance(req, ChatCompletionRequest)
        lora = self._check_model(req.model)
        session = req.session_id or request.headers.get("x-session-id")
        if session is not None and not 0 < len(session) <= 256:
            raise APIError(400, "X-Session-Id must be 1 to 256 characters", param="session_id")
        # Templating and tokenizing a long history would stall every stream on the event loop.
        ids = await asyncio.to_thread(self.chat_prompt if chat else self.completion_prompt, req)
        params = self.sampling_params(req, len(ids))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = self.server.submit(
            rid, ids, params, priority=req.priority, user=req.user, session_id=session, lora=lora
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # Closing the stream in a background task too covers a client that leaves before
            # the body generator ever starts (its own `finally` would then never run).
            return StreamingResponse(
                self._sse(stream, chat, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(stream.close),
            )
        try:
            final = await _until_done(stream, request.is_disconnected)
        finally:
            stream.close()
        if final is None:  # the client left; nobody reads this (499: nginx's "client closed")
            return Response(status_code=499)
        if chat:
            body: BaseModel = ChatCompletionResponse(
                id=rid,
                model=self.model_name,
                usage=_usage(final),
                choices=[
                    ChatChoice(
                        message=AssistantMessage(content=final.text),
                        finish_reason=final.finish_reason,
                    )
                ],
            )
        else:
            body = CompletionResponse(
                id=rid,
                model=self.model_name,
                usage=_usage(final),
                choices=[CompletionChoice(text=final.text, finish_reason=final.finish_reason)],
            )
        return JSONResponse(body.model_dump())

    async def _sse(
        self, stream: RequestStream, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def event(choice: dict | None, usage: Usage | None = None) -> str:
            body = chunk(
                stream.request_id,
                obj,
                created,
                self.model_name,
                choice,
                usage,
                with_usage_field=include_usage,
            )
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def choice(text: str | None, finish: str | None, role: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            delta = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        try:
            if chat:
                yield event(choice(None, None, role=True))
            async for out in stream:
                if out.delta_text or out.finished:
                    yield event(choice(out.delta_text, out.finish_reason if out.finished else None))
                if out.finished and include_usage:
                    yield event(None, _usage(out))
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        finally:
            stream.close()
        yield "data: [DONE]\n\n"


async def _until_done(
    stream: RequestStream, is_disconnected: Callable[[], Awaitable[bool]]
) -> RequestOutput | None:
    """The final output, or None if the client disconnects first."""
    final: RequestOutput | None = None

    async def collect() -> None:
        nonlocal final
        async for out in stream:
            final = out

    task = asyncio.ensure_future(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await is_disconnected():
            task.cancel()
            return None
    task.result()
    return final


def _usage(out: RequestOutput) -> Usage:
    m = out.metrics
    return Usage(
        prompt_tokens=m.num_prompt_tokens,
        completion_tokens=m.num_output_tokens,
        total_tokens=m.num_prompt_tokens + m.num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=m.num_cached_tokens),
    )
