"""From a validated OpenAI request to engine work and back: prompt, limits, JSON or SSE.

The request is checked against the model (name, context length) before admission, so a bad
request never takes a queue slot. Streams are Server-Sent Events ending in `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tutorserve.engine.async_engine import AsyncEngine, OutputStream
from tutorserve.engine.outputs import RequestOutput
from tutorserve.sampling_params import ParamError, SamplingParams, StructuredOutputs
from tutorserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    NamedToolChoice,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    error_body,
)
from tutorserve.server.reply import Reply
from tutorserve.server.tools import (
    ToolPolicy,
    template_messages,
    template_supports_tools,
    tool_policy,
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

    def chat_prompt(self, req: ChatCompletionRequest, policy: ToolPolicy) -> list[int]:
        tools = req.tool_dicts() if policy.offers_tools else None
        return self._checked(self.chat_ids(req.messages, tools=tools), "messages")

    def chat_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The conversation as the model's chat template renders it, not yet checked."""
        template = self.tokenizer.chat_template
        if not template:
            raise APIError(
                400, "this model has no chat template; use /v1/completions", param="messages"
            )
        native = template_supports_tools(template)
        rendered = template_messages([m.template_dict() for m in messages], tools, native)
        return self.tokenizer.encode_chat(
            rendered, add_generation_prompt, add_special_tokens, tools=tools if native else None
        )

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
        self,
        req: ChatCompletionRequest | CompletionRequest,
        num_prompt: int,
        structured: StructuredOutputs | None,
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
        if req.min_tokens > (limit or room):
            raise APIError(400, "min_tokens is over max_tokens", param="min_tokens")
        if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        params = SamplingParams(
            max_tokens=limit or room,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k or -1,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()},
            min_tokens=req.min_tokens,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logprobs=req.num_logprobs,
            prompt_logprobs=req.num_logprobs
            if isinstance(req, CompletionRequest) and req.echo
            else None,
            structured=structured,
        )
        try:
            params.check_vocab(self.server.vocab_size)
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from e
        return params

    async def _compiled(self, spec: StructuredOutputs | None, param: str) -> None:
        """Compile the request's grammar before it is queued (the engine reuses it), so a bad
        schema is a 400 and not an aborted request; off the event loop, as it may take ms."""
        if spec is None:
            return
        try:
            await asyncio.to_thread(self.server.check_structured, spec)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from e

    # ---- vLLM's tokenizer routes ----------------------------------------------------------------
    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        """Token ids as a generation request would get them. The context length is not checked:
        clients count with this to fit their prompts to it, so it is returned instead."""
        if req.model is not None:
            self._check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = await asyncio.to_thread(
                self.chat_ids, req.messages, req.add_generation_prompt, req.add_special_tokens
            )
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, req.add_special_tokens)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.max_model_len,
            tokens=ids,
            token_strs=self.tokenizer.token_strs(ids) if req.return_token_strs else None,
        )

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        if req.model is not None:
            self._check_model(req.model)
        return await asyncio.to_thread(self._detokenize, req.tokens)

    def _detokenize(self, ids: list[int]) -> DetokenizeResponse:
        # The tokenizer's vocabulary, not the model's (which may be padded past it): only ids the
        # tokenizer can name decode to text; it would skip the others silently.
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise APIError(
                400,
                f"token ids must lie in [0, {vocab}): {bad} is outside the vocabulary",
                param="tokens",
            )
        # Special tokens stay in, as in vLLM: this shows what the model reads.
        return DetokenizeResponse(prompt=self.tokenizer.decode(ids, skip_special_tokens=False))

    # ---- running it ---------------------------------------------------------------------------
    async def create(
        self, req: ChatCompletionRequest | CompletionRequest, request: Request
    ) -> Response:
        chat = isinstance(req, ChatCompletionRequest)
        lora = self._check_model(req.model)
        session = req.session_id or request.headers.get("x-session-id")
        if session is not None and not 0 < len(session) <= 256:
            raise APIError(400, "X-Session-Id must be 1 to 256 characters", param="session_id")
        policy = self._tool_policy(req) if chat else ToolPolicy()
        structured, param = _structured(req, policy)
        await self._compiled(structured, param)
        # Templating and tokenizing a long history would stall every stream on the event loop.
        if chat:
            ids = await asyncio.to_thread(self.chat_prompt, req, policy)
        else:
            ids = await asyncio.to_thread(self.completion_prompt, req)
        params = self.sampling_params(req, len(ids), structured)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = self.server.submit(
            rid, ids, params, priority=req.priority, user=req.user, session_id=session,
            lora=lora, n=req.n,
        )  # fmt: skip
        echo = None
        if not chat and req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(ids)
        reply = Reply(rid, self.model_name, self.tokenizer, chat, req.n, policy, echo)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # Closing the stream in a background task too covers a client that leaves before
            # the body generator ever starts (its own `finally` would then never run).
            return StreamingResponse(
                reply.events(stream, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(stream.close),
            )
        try:
            finals = await _until_done(stream, request.is_disconnected)
        finally:
            stream.close()
        if finals is None:  # the client left; nobody reads this (499: nginx's "client closed")
            return Response(status_code=499)
        return JSONResponse(reply.body(finals))

    def _tool_policy(self, req: ChatCompletionRequest) -> ToolPolicy:
        tools = req.tool_dicts()
        choice = req.tool_choice
        try:
            return tool_policy(
                tools, choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
                req.parallel_tool_calls,
            )  # fmt: skip
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from e


def _structured(
    req: ChatCompletionRequest | CompletionRequest, policy: ToolPolicy
) -> tuple[StructuredOutputs | None, str]:
    """The request's output constraint and the field it came from."""
    if policy.constraint is not None:
        if req.response_format is not None or req.structured_outputs is not None:
            raise APIError(400, "a forced tool call cannot also have a response format",
                           param="tool_choice")  # fmt: skip
        return StructuredOutputs(json=json.dumps(policy.constraint)), "tools"
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None:
        if fmt.type == "json_object":
            return StructuredOutputs(json_object=True), "response_format"
        if fmt.type == "json_schema" and fmt.json_schema.schema_ is not None:
            return StructuredOutputs(json=json.dumps(fmt.json_schema.schema_)), "response_format"
        if fmt.type == "json_schema":  # no schema given: any JSON object, as OpenAI does
            return StructuredOutputs(json_object=True), "response_format"
        return None, "response_format"
    if so is None:
        return None, "structured_outputs"
    try:
        spec = StructuredOutputs(
            json=so.json_ if isinstance(so.json_, str | None) else json.dumps(so.json_),
            json_object=bool(so.json_object),
            regex=so.regex,
            choice=None if so.choice is None else tuple(so.choice),
            grammar=so.grammar,
        )
    except ValueError as e:
        raise APIError(400, f"structured_outputs: {e}", param="structured_outputs") from e
    return spec, "structured_outputs"


async def _until_done(
    stream: OutputStream, is_disconnected: Callable[[], Awaitable[bool]]
) -> list[RequestOutput] | None:
    """Each choice's final output, or None if the client disconnects first."""
    finals: list[RequestOutput] = []

    async def collect() -> None:
        async for out in stream:
            if out.finished:
                finals.append(out)

    task = asyncio.ensure_future(collect())
    while not task.done():
        # A departed client's request holds KV blocks until this notices: look often (a
        # disconnect check only reads the ASGI receive queue).
        await asyncio.wait({task}, timeout=0.1)
        if not task.done() and await is_disconnected():
            task.cancel()
            return None
    task.result()
    return sorted(finals, key=lambda o: o.index)
