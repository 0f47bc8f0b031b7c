"""One chat-model interface for the tutor's agents: our in-process engine, or any
OpenAI-compatible server (vLLM, a hosted API, another tutorserve) by base URL.

Both stream text deltas; leaving the iteration early aborts the generation (the engine frees the
request's KV blocks; the HTTP client closes the stream), which the answer-leak guard relies on.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from tutorserve.engine.async_engine import AsyncEngine
from tutorserve.sampling_params import SamplingParams, StructuredOutputs
from tutorserve.tutor.costs import report_usage

Messages = list[dict[str, str]]


class ChatLLM(Protocol):
    """`scope` names the calls whose replies tend to repeat (one problem's hints at one rung):
    our engine's speculative decoding drafts each from the others. `schema` is the JSON schema
    the reply must match, enforced by constrained decoding (our engine's `structured_outputs`,
    an OpenAI server's `response_format`); the caller still checks it, as a server may ignore
    it. `priority`: the server's scheduling priority (lower first; vLLM's extension). A client
    reports each call's token counts with `costs.report_usage`."""

    name: str

    def stream(
        self, messages: Messages, *, max_tokens: int, temperature: float, session_id: str | None,
        scope: str | None = None, schema: dict[str, Any] | None = None, priority: int = 0,
    ) -> AsyncIterator[str]: ...  # fmt: skip


async def complete(
    llm: ChatLLM,
    messages: Messages,
    *,
    max_tokens: int,
    temperature: float = 0.0,
    session_id: str | None = None,
    scope: str | None = None,
    schema: dict[str, Any] | None = None,
    priority: int = 0,
) -> str:
    parts = [
        d
        async for d in llm.stream(
            messages, max_tokens=max_tokens, temperature=temperature, session_id=session_id,
            scope=scope, schema=schema, priority=priority,
        )
    ]  # fmt: skip
    return "".join(parts)


class EngineLLM:
    """The engine this server runs, without an HTTP hop."""

    def __init__(self, server: AsyncEngine, name: str, lora: str | None = None) -> None:
        self.server = server
        self.name = name
        self.lora = lora

    def _prompt(self, messages: Messages, max_tokens: int) -> list[int]:
        ids = self.server.tokenizer.encode_chat(messages)
        # Keep the tail within the context: the task comes last, the course prefix first.
        room = self.server.max_model_len - max_tokens - 1
        if len(ids) > room:
            raise ValueError(f"tutor prompt of {len(ids)} tokens leaves no room to answer")
        return ids

    async def stream(
        self, messages: Messages, *, max_tokens: int, temperature: float, session_id: str | None,
        scope: str | None = None, schema: dict[str, Any] | None = None, priority: int = 0,
    ) -> AsyncIterator[str]:  # fmt: skip
        ids = await asyncio.to_thread(self._prompt, messages, max_tokens)
        structured = None if schema is None else StructuredOutputs(json=json.dumps(schema))
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=0, structured=structured
        )
        rid = f"tutor-{uuid.uuid4().hex}"
        async with self.server.submit(
            rid, ids, params, priority=priority, session_id=session_id, lora=self.lora,
            spec_scope=scope,
        ) as stream:  # fmt: skip
            last = None
            try:
                async for out in stream:
                    last = out
                    if out.delta_text:
                        yield out.delta_text
            finally:
                if last is not None:
                    m = last.metrics
                    report_usage(m.num_prompt_tokens, m.num_cached_tokens, m.num_output_tokens)


class OpenAILLM:
    """Any OpenAI-compatible chat endpoint (`base_url` ends in /v1)."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, http_client: Any = None
    ) -> None:
        """`http_client`: an `httpx.AsyncClient` of the caller's (a proxy, a test transport)."""
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(
            base_url=base_url, api_key=api_key or "none", max_retries=1, http_client=http_client
        )
        self.name = model

    async def stream(
        self, messages: Messages, *, max_tokens: int, temperature: float, session_id: str | None,
        scope: str | None = None, schema: dict[str, Any] | None = None, priority: int = 0,
    ) -> AsyncIterator[str]:  # fmt: skip
        headers = {"X-Session-Id": session_id} if session_id else None
        extra: dict[str, Any] = {"extra_body": {"priority": priority}} if priority else {}
        if schema is not None:
            extra["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "reply", "schema": schema, "strict": True},
            }
        chunks = await self.client.chat.completions.create(
            model=self.name,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
            **extra,
        )
        try:
            async for chunk in chunks:
                if chunk.usage is not None:
                    details = chunk.usage.prompt_tokens_details
                    cached = (details.cached_tokens or 0) if details else 0
                    u = chunk.usage
                    report_usage(u.prompt_tokens, cached, u.completion_tokens)
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content
        finally:
            await chunks.close()
