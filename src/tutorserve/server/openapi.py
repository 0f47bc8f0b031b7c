"""What the OpenAPI schema says of each route: its error statuses with the OpenAI error body,
bodies that are not JSON (plain text, Server-Sent Events), and no status the server never
sends."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tutorserve.server.protocol import ErrorResponse

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: bad JSON, or a value the schema or the model refuses (`param` names "
    "the field).",
    401: "Missing or wrong API key (only when the server has one).",
    404: "Unknown model, LoRA adapter, session or learner (`param` names which).",
    409: "Busy: a session still answering its last turn, or an adapter still in use.",
    413: "The body is over the server's size cap.",
    429: "The server is at capacity; retry after the `Retry-After` header's seconds.",
    503: "The engine is not running.",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for these statuses, each with the OpenAI error body. FastAPI documents them
    in the route's media type, so a route whose success is not JSON declares
    `response_class=Response` (none) and its success with `text_response`."""
    return {c: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[c]} for c in codes}


def text_response(
    media_type: str, description: str, schema: dict[str, Any] | None = None
) -> dict[int | str, dict[str, Any]]:
    """An OpenAPI 200 whose body is not JSON (plain text by default). FastAPI merges it with the
    route's JSON 200 where there is one (a route that streams on request)."""
    return {
        200: {
            "description": description,
            "content": {media_type: {"schema": schema or {"type": "string"}}},
        }
    }


def sse_event(data: str, names: tuple[str, ...] = ("message",)) -> dict[str, Any]:
    """The schema of one Server-Sent Event: what an event stream's `schema` describes in OpenAPI
    3.1 (3.2 calls it `itemSchema`). Ours carry `data` and maybe `event` (a client reads an event
    without one as "message"), never `id` or `retry`."""
    return {
        "type": "object",
        "properties": {
            "data": {"type": "string", "description": data},
            "event": {"enum": list(names)},
        },
        "required": ["data"],
        "additionalProperties": False,
    }


def truthful_openapi(app: FastAPI) -> None:
    """FastAPI documents a 422 for every route with a body or parameters; validation errors are
    400s here (OpenAI's status), which each route documents, so the 422 and its schemas go."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
