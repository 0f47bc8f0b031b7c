"""The HTTP server: routes, access control, body cap, and OpenAI-style errors for every failure."""

from __future__ import annotations

import gc
import hmac
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tutorserve.engine.async_engine import AdmissionError, AsyncEngine, EngineDeadError
from tutorserve.server.audio import Voice, audio_router
from tutorserve.server.metrics import CONTENT_TYPE, EngineMetrics
from tutorserve.server.openapi import error_responses, sse_event, text_response, truthful_openapi
from tutorserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    error_body,
)
from tutorserve.server.serving import APIError, OpenAIServing
from tutorserve.server.tutor_api import tutor_router
from tutorserve.server.tutor_metrics import TutorCollector
from tutorserve.server.voice_socket import voice_socket_router
from tutorserve.tutor.service import TutorService

log = logging.getLogger(__name__)
_STATIC = files("tutorserve.server").joinpath("static")
_TUTOR_PAGE = _STATIC.joinpath("tutor.html").read_text("utf-8")
_CHAT_PAGE = _STATIC.joinpath("chat.html").read_text("utf-8")
_CLIENT_JS = _STATIC.joinpath("client.js").read_text("utf-8")
_SSE = "text/event-stream"
# OpenAI's stream: unnamed events, ending with `data: [DONE]`.
_CHUNK_EVENT = sse_event("a chunk object as JSON, an error body as JSON, or `[DONE]` last")


@dataclass(slots=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = 4 << 20


def _error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status, headers=headers)


class BodyLimit:
    """413 for bodies over the cap, whether or not the client declares Content-Length.

    The body is read here in full (it is small by construction) and replayed to the app; later
    receives go to the server, so the app still hears about client disconnects.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._reject(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = _error(
            413, f"request body is over {self.max_bytes} bytes", code="request_too_large"
        )
        await response(scope, receive, send)


class ApiKeyAuth:
    """`/v1/*` needs `Authorization: Bearer KEY`; the key is compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                response = _error(
                    401,
                    "missing or incorrect API key; send Authorization: Bearer <key>",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _param(loc: tuple[Any, ...]) -> str | None:
    # ("body", "messages", 0, "role") -> "messages.0.role", without pydantic's union-member tags.
    return ".".join(str(p) for p in loc[1:] if not _union_tag(p)) or None


def _union_tag(part: Any) -> bool:
    # A member's type ("str", "list[int]", "constrained-str", "function-after"), or a model's
    # class name: capitalized, unlike every field name of the API.
    return isinstance(part, str) and (
        "[" in part
        or part[:1].isupper()
        or part.startswith(("constrained-", "function-"))
        or part in {"str", "int", "float", "bool", "list"}
    )


def build_app(
    server: AsyncEngine, settings: ServerSettings, tutor: TutorService | None = None
) -> FastAPI:
    serving = OpenAIServing(server, settings.model_name)
    # A cluster front (`ClusterFront`) also reports each replica: its metrics and health.
    replica_stats = getattr(server, "replica_stats", None)
    cluster_health = getattr(server, "health", None)
    exporter = EngineMetrics(server.stats, replica_stats)
    server.on_finished, server.on_rejected = exporter.observe_finished, exporter.observe_rejected
    if tutor is not None:
        exporter.registry.register(TutorCollector(tutor))

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        await server.start()
        if tutor is not None:
            await tutor.start()
        # What start-up built (the model, the libraries) lives as long as the server: moved out
        # of the collector's reach, a full collection walks only what serving allocates. It
        # walked ~190,000 objects for 135 ms with the default model, holding the GIL, so every
        # stream paused with it (docs/benchmarks/serving.md).
        gc.freeze()
        yield
        gc.unfreeze()  # an app built again in this process (tests) must not pin this one
        if tutor is not None:
            await tutor.close()  # turns in flight still assess and store their answer
        await server.stop()

    # No /docs: Swagger UI loads its assets from a CDN, which a closed network cannot reach.
    app = FastAPI(
        title="tutorserve",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        description="OpenAI-compatible LLM server for tutoring.",
    )
    truthful_openapi(app)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Of a union's members, the one that got furthest is the one meant: the deepest error,
        # and one about a value over one about its type (a list of token ids with a bad id, or
        # too many stop strings, not "should be a string").
        err = max(
            exc.errors(),
            key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type")),
        )
        if err.get("type") == "json_invalid":
            return _error(
                400,
                f"request body is not valid JSON: {err.get('ctx', {}).get('error')}",
                code="invalid_json",
            )
        param = _param(tuple(err.get("loc", ())))
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        message = f"{param}: {msg}" if param else f"request body: {msg}"
        return _error(400, message, param=param, code="invalid_value")

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(AdmissionError)
    async def full(_: Request, exc: AdmissionError) -> JSONResponse:
        return _error(
            429,
            str(exc),
            "rate_limit_error",
            code="server_busy",
            headers={"Retry-After": str(exc.retry_after)},
        )

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), "server_error", code="engine_unavailable")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), headers=exc.headers)

    generation_errors = error_responses(400, 401, 404, 413, 429, 503)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={
            **text_response(
                _SSE, "The reply; with `stream: true`, Server-Sent Events.", _CHUNK_EVENT
            ),
            **generation_errors,
        },
    )
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        """A chat reply; with `stream: true`, Server-Sent Events of `chat.completion.chunk`."""
        return await serving.create(req, request)

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={
            **text_response(
                _SSE, "The completion; with `stream: true`, Server-Sent Events.", _CHUNK_EVENT
            ),
            **generation_errors,
        },
    )
    async def completions(req: CompletionRequest, request: Request) -> Any:
        """A plain-text completion; with `stream: true`, Server-Sent Events."""
        return await serving.create(req, request)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    async def models() -> ModelList:
        base, n = settings.model_name, serving.max_model_len
        adapters = [
            ModelCard(id=name, max_model_len=n, root=path, parent=base)
            for name, path in server.lora_adapters().items()
        ]
        return ModelList(data=[ModelCard(id=base, max_model_len=n), *adapters])

    @app.post(
        "/v1/load_lora_adapter",
        response_class=Response,
        responses={
            **text_response("text/plain", "The adapter is loaded."),
            **error_responses(400, 401, 413, 503),
        },
    )
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Register a PEFT adapter folder; requests then use it with `model` = `lora_name`."""
        if req.lora_name == settings.model_name:
            raise APIError(400, "lora_name must differ from the base model's", param="lora_name")
        try:
            await server.load_lora(req.lora_name, req.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from e
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=Response,
        responses={
            **text_response("text/plain", "The adapter is unloaded."),
            **error_responses(400, 401, 404, 409, 413, 503),
        },
    )
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            await server.unload_lora(req.lora_name)
        except KeyError as e:
            raise APIError(
                404, f"LoRA adapter '{req.lora_name}' is not loaded", param="lora_name",
                code="model_not_found",
            ) from e  # fmt: skip
        except ValueError as e:
            raise APIError(409, str(e), param="lora_name") from e
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    # vLLM's routes, outside /v1 as there (so they need no API key either).
    @app.post(
        "/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 404, 413)
    )
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        """A prompt's or a conversation's token ids; `count` may exceed `max_model_len`."""
        return await serving.tokenize(req)

    @app.post(
        "/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 404, 413)
    )
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.detokenize(req)

    @app.get("/health", response_model=HealthResponse, responses=error_responses(503))
    async def health() -> Any:
        """200 while the engine runs (a cluster: while some replica answers)."""
        if not server.healthy:
            reason = (
                "no engine replica answers" if cluster_health else "the engine loop is not running"
            )
            return _error(503, reason, "server_error")
        return HealthResponse(
            tutor=tutor.health() if tutor is not None else None,
            cluster=cluster_health() if cluster_health else None,
        )

    @app.get(
        "/metrics",
        response_class=Response,
        responses=text_response("text/plain", "Prometheus metrics, text format."),
    )
    async def metrics() -> Response:
        return Response(exporter.render(), media_type=CONTENT_TYPE)

    voice = Voice.from_env()  # cheap: Whisper loads at the first spoken request
    app.include_router(audio_router(voice))
    if tutor is not None:
        app.include_router(tutor_router(tutor, voice))
        app.include_router(voice_socket_router(tutor, voice, settings.api_key))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(_TUTOR_PAGE if tutor is not None else _CHAT_PAGE)

    @app.get("/chat", response_class=HTMLResponse, include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(_CHAT_PAGE)

    @app.get("/static/client.js", include_in_schema=False)
    async def client_js() -> Response:
        return Response(_CLIENT_JS, media_type="text/javascript")

    return app
