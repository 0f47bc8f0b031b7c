"""One response's choices from the engine's outputs: the JSON body, or its Server-Sent Events
(OpenAI's stream: a chunk per step per choice, `usage` last if asked, then `data: [DONE]`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tutorserve.engine.async_engine import OutputStream
from tutorserve.engine.outputs import RequestOutput
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.server.logprobs import chat_logprobs, completion_logprobs
from tutorserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
    chunk,
    error_body,
)
from tutorserve.server.tools import ToolPolicy


@dataclass(slots=True)
class _Sent:
    """How much of a choice a stream has sent."""

    chars: int = 0  # of its text, as content
    logprobs: int = 0  # entries
    offset: int = 0  # text offset of the next legacy logprobs entry
    echoed: bool = False  # completions with echo: the prompt's text has gone out


class Reply:
    def __init__(
        self,
        response_id: str,
        model: str,
        tokenizer: Tokenizer,
        chat: bool,
        n: int,
        policy: ToolPolicy,
        echo: str | None,
    ) -> None:
        self.id = response_id
        self.model = model
        self.tokenizer = tokenizer
        self.chat = chat
        self.n = n
        self.policy = policy
        self.echo = echo  # completions: the prompt's text, to put before each choice's

    # ---- the whole response ---------------------------------------------------------------
    def body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        usage = _usage(finals)
        if self.chat:
            choices = []
            for out in finals:
                content, calls = self.policy.finish(out.text)
                choices.append(
                    ChatChoice(
                        index=out.index,
                        message=AssistantMessage(content=content, tool_calls=calls),
                        logprobs=self._chat_logprobs(out, 0),
                        finish_reason=_finish_reason(out, calls),
                    )
                )
            return ChatCompletionResponse(
                id=self.id, model=self.model, choices=choices, usage=usage
            ).model_dump()
        echo = self.echo or ""
        return CompletionResponse(
            id=self.id,
            model=self.model,
            usage=usage,
            choices=[
                CompletionChoice(
                    index=out.index,
                    text=echo + out.text,
                    logprobs=self._completion_logprobs(out, 0, 0, echo=self.echo is not None),
                    finish_reason=out.finish_reason,
                )
                for out in finals
            ],
        ).model_dump()

    def _chat_logprobs(self, out: RequestOutput, start: int) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, out.logprobs[start:])

    def _completion_logprobs(
        self, out: RequestOutput, start: int, offset: int, echo: bool = False
    ) -> dict[str, Any] | None:
        """Output tokens from `start` on; with `echo`, the prompt's tokens before them."""
        if out.logprobs is None:
            return None
        if not echo:
            return completion_logprobs(self.tokenizer, out.logprobs[start:], offset)
        entries = (out.prompt_logprobs or []) + out.logprobs[start:]
        return completion_logprobs(self.tokenizer, entries, offset, out.prompt_token_ids[0])

    # ---- streamed -------------------------------------------------------------------------
    async def events(self, stream: OutputStream, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        created = int(time.time())

        def event(choice: dict | None, usage: Usage | None = None) -> str:
            body = chunk(self.id, obj, created, self.model, choice, usage,
                         with_usage_field=include_usage)  # fmt: skip
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        sent = [_Sent() for _ in range(self.n)]
        finals: list[RequestOutput] = []
        try:
            if self.chat:
                for i in range(self.n):
                    yield event(_delta(i, {"role": "assistant", "content": ""}, None, None))
            async for out in stream:
                choice = self._chat_chunk(out, sent[out.index]) if self.chat else (
                    self._text_chunk(out, sent[out.index]))  # fmt: skip
                if choice is not None:
                    yield event(choice)
                if out.finished:
                    finals.append(out)
            if include_usage:
                yield event(None, _usage(finals))
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

    def _chat_chunk(self, out: RequestOutput, sent: _Sent) -> dict[str, Any] | None:
        text, calls = out.text, []
        upto = self.policy.streamable(text)
        if out.finished:
            _, calls = self.policy.finish(text)
            if not calls:
                upto = len(text)
        delta: dict[str, Any] = {}
        if upto > sent.chars:
            delta["content"] = text[sent.chars : upto]
            sent.chars = upto
        if calls:
            delta["tool_calls"] = [{"index": k} | c for k, c in enumerate(calls)]
        logprobs = self._chat_logprobs(out, sent.logprobs)
        sent.logprobs = len(out.logprobs or ())
        finish = _finish_reason(out, calls) if out.finished else None
        if not delta and finish is None and not (logprobs and logprobs["content"]):
            return None
        return _delta(out.index, delta, logprobs, finish)

    def _text_chunk(self, out: RequestOutput, sent: _Sent) -> dict[str, Any] | None:
        """With echo, a choice's first chunk (its first token: the prompt is computed) carries
        the prompt's text and log-probabilities too."""
        echo = self.echo is not None and not sent.echoed
        text = (self.echo if echo else "") + out.text[sent.chars :]
        sent.chars, sent.echoed = len(out.text), True
        logprobs = self._completion_logprobs(out, sent.logprobs, sent.offset, echo=echo)
        sent.logprobs = len(out.logprobs or ())
        if logprobs is not None:
            sent.offset += sum(len(t) for t in logprobs["tokens"])
        if not text and not out.finished and not (logprobs and logprobs["tokens"]):
            return None
        return _text(out.index, text, logprobs, out.finish_reason if out.finished else None)


def _delta(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _text(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _finish_reason(out: RequestOutput, calls: list) -> str | None:
    return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason


def _usage(finals: list[RequestOutput]) -> Usage:
    """The prompt counted once, every choice's output tokens."""
    m = finals[0].metrics if finals else None
    prompt = m.num_prompt_tokens if m else 0
    completion = sum(o.metrics.num_output_tokens for o in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=m.num_cached_tokens if m else 0),
    )
