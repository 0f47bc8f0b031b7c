"""OpenAI API request and response shapes (plus vLLM's extensions: top_k, priority, ignore_eos,
repetition_penalty, min_tokens, stop_token_ids, structured_outputs).

Requests validate strictly (a string is not a number) and say which field is wrong; bounds are
in the schema wherever JSON Schema can say them. Fields of the OpenAI API we do not implement are
accepted only at their neutral value, so a client never gets silently different behaviour;
unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from tutorserve.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS

MAX_CHOICES = 128  # n, as OpenAI caps it
MAX_REPETITION_PENALTY = 10.0


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _integral(v: Any) -> Any:
    # JSON has one number type, and JSON Schema (which our OpenAPI schema promises) counts 1.0
    # as an integer; the strict int check after this still refuses 1.5, "1" and true.
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


_INTEGRAL = BeforeValidator(_integral)
# The integer fields of requests. A bound goes before the validator: one applied on top of it
# reaches the JSON schema as pydantic's "ge"/"le", which JSON Schema ignores, not "minimum".
JsonInt = Annotated[int, _INTEGRAL]
PositiveInt = Annotated[int, Field(ge=1), _INTEGRAL]
# Its upper bound, the vocabulary's size, depends on the model and is checked per request.
TokenId = Annotated[int, Field(ge=0), _INTEGRAL]
# OpenAI's bounds for a seed (an int64); larger ones overflow the engine's random generator.
# The upper one is exclusive because FastAPI writes bounds as floats, and 2**63 is one exactly.
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63), _INTEGRAL]


class StreamOptions(_Request):
    include_usage: bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: str


_Name = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's function names


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    # "developer" is the newer name of "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's convention)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDefinition(_Request):
    name: _Name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: _Name
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None


_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
_Stop = Annotated[str, Field(min_length=1)]


class _SamplingRequest(_Request):
    """Fields the OpenAI API lets a client send as null are typed `X | None` here and mean
    their default then (`_nulls_are_defaults`): after validation they always hold a value."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[int, Field(ge=-1), _INTEGRAL] | None = -1  # 0 or -1: off (vLLM)
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES), _INTEGRAL] | None = 1
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    priority: JsonInt = 0
    # A student's conversation (or the X-Session-Id header): its KV is kept between turns.
    session_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    ignore_eos: bool | None = False
    presence_penalty: _Penalty | None = 0.0
    frequency_penalty: _Penalty | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY)] | None = 1.0
    min_tokens: Annotated[int, Field(ge=0), _INTEGRAL] | None = 0
    logit_bias: (
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
             Annotated[float, Field(ge=-100.0, le=100.0)]] | None
    ) = None  # fmt: skip
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        return [v] if isinstance(v, str) else list(v or [])

    @model_validator(mode="after")
    def _nulls_are_defaults(self) -> _SamplingRequest:
        for name, field in type(self).model_fields.items():
            if getattr(self, name) is None and field.default is not None:
                setattr(self, name, field.default)
        return self

    @model_validator(mode="after")
    def _consistent(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _INTEGRAL] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as a chat template lists them (fields the client left out stay out)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or []]


class CompletionRequest(_SamplingRequest):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _INTEGRAL] | None = None
    suffix: None = None
    best_of: Annotated[Literal[1], _INTEGRAL] | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# ---- responses ------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobs(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobs] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tutorserve"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder (as vLLM lists them)
    parent: str | None = None  # a LoRA adapter's base model


class LoadLoRAAdapterRequest(_Request):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(_Request):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def chunk(
    response_id: str,
    obj: str,
    created: int,
    model: str,
    choice: dict[str, Any] | None,
    usage: Usage | None = None,
    *,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    """One SSE payload; with include_usage every chunk carries `usage` (null until the last)."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice] if choice is not None else [],
    }
    if with_usage_field or usage is not None:
        body["usage"] = usage.model_dump() if usage is not None else None
    return body


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
    # Each tutor model endpoint's circuit breaker (state, calls and failures in its window).
    tutor: dict[str, Any] | None = None
    # With engine replicas: each that answered the last stats round (its running and waiting
    # requests and adapters, by replica id), and Serve's count of replicas by state.
    cluster: dict[str, Any] | None = None


# ---- vLLM's /tokenize and /detokenize -------------------------------------------------------
class TokenizeCompletionRequest(_Request):
    # A body with `messages` is a chat request (see TokenizeRequest); the schema says so too.
    model_config = ConfigDict(json_schema_extra={"not": {"required": ["messages"]}})

    # Optional, as in vLLM: base model and LoRA adapters share one tokenizer.
    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)]
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    # On top of those the chat template writes itself (vLLM's default is none).
    add_special_tokens: bool = False
    continue_final_message: Literal[False] = False
    return_token_strs: bool | None = False


def _tokenize_kind(body: Any) -> str:
    is_chat = isinstance(body, dict) and "messages" in body
    return "TokenizeChatRequest" if is_chat else "TokenizeCompletionRequest"


# vLLM's two shapes. `messages` picks one, so that a bad body's error names a field of the shape
# the client meant instead of the first shape's; the tags are the classes' names, which is how
# pydantic names union members in an error's location.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_kind),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(min_length=1)]


class DetokenizeResponse(BaseModel):
    prompt: str
