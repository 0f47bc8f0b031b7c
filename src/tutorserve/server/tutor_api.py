"""The tutor's HTTP API under /v1/tutor; errors use the OpenAI-style body of the rest of the server.

A turn streams as Server-Sent Events with named events: `delta` (reply text), `reset` (drop the
text shown so far: the answer-leak guard replaced it), `final` (diagnosis, ladder level, mastery
changes, timing), `engage` (a short encouragement computed after `final`), or `error`. A turn
spoken as multipart audio (`server/audio.py`) adds `transcript` first (what was heard, also in
`final`) and `audio` (a sentence of the reply as a base64 WAV) while the reply streams.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from tutorserve.server.audio import Voice, read_voice_turn, voice_errors
from tutorserve.server.openapi import error_responses, sse_event, text_response
from tutorserve.server.protocol import error_body
from tutorserve.server.serving import APIError
from tutorserve.tutor.quotas import QuotaExceeded
from tutorserve.tutor.service import SessionBusyError, TutorService, UnknownCourseError

# Where a new session's id and learner lead (OpenAPI links, which clients and schemathesis's
# stateful tests follow).
_SESSION_LINKS = {
    "GetSession": {
        "operationId": "get_session",
        "parameters": {"session_id": "$response.body#/id"},
    },
    "TakeTurn": {"operationId": "take_turn", "parameters": {"session_id": "$response.body#/id"}},
    "GetLearner": {
        "operationId": "get_learner",
        "parameters": {"learner_id": "$response.body#/learner_id"},
    },
}

_TURN_EVENT = sse_event(
    "the event's fields as JSON",
    ("transcript", "delta", "reset", "final", "audio", "engage", "error"),
)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SessionRequest(_Body):
    learner_id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\w.@-]+$")]
    course: Annotated[str, Field(min_length=1, max_length=64)]
    # The tenant charged for the learner's turns and whose quota they count against.
    school: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[\w.@-]+$")] | None = None


class TurnRequest(_Body):
    message: Annotated[str, Field(min_length=1, max_length=4000)]


# Text as JSON, or speech as a form (what a browser's MediaRecorder makes, as WAV or WebM/Opus).
_TURN_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": TurnRequest.model_json_schema()},
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "speak": {"type": "boolean", "default": True},
                    "voice": {"type": "string"},
                    "language": {"type": "string"},
                },
            }
        },
    },
}


async def _text_turn(request: Request) -> TurnRequest:
    try:
        return TurnRequest.model_validate_json(await request.body())
    except ValidationError as e:  # the app's handler words it like any other body error
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        ) from e


def _not_found(e: KeyError, param: str) -> APIError:
    return APIError(404, str(e.args[0]), param=param, code="not_found")


def tutor_router(service: TutorService, voice: Voice | None = None) -> APIRouter:
    router = APIRouter(prefix="/v1/tutor", tags=["tutor"])

    @router.get("/courses", operation_id="list_courses", responses=error_responses(401))
    async def courses() -> dict[str, Any]:
        return {
            "data": [
                {
                    "id": c.id,
                    "title": c.title,
                    "subject": c.subject,
                    "description": c.description,
                    "problems": len(c.problems),
                    "kcs": [{"id": k.id, "name": k.name, "cefr": k.cefr} for k in c.kcs],
                }
                for c in service.courses.values()
            ]
        }

    @router.post(
        "/sessions",
        operation_id="start_session",
        responses={
            200: {"description": "The new session.", "links": _SESSION_LINKS},
            **error_responses(400, 401, 413),
        },
    )
    async def start_session(req: SessionRequest) -> dict[str, Any]:
        """Start tutoring `learner_id` (created on first use) on `course`."""
        try:
            return await service.start_session(req.learner_id, req.course, req.school)
        except UnknownCourseError as e:
            raise APIError(400, str(e), param="course", code="course_not_found") from e

    @router.get(
        "/sessions/{session_id}", operation_id="get_session", responses=error_responses(401, 404)
    )
    async def get_session(session_id: str) -> dict[str, Any]:
        try:
            return await service.session(session_id)
        except KeyError as e:
            raise _not_found(e, "session_id") from e

    @router.post(
        "/sessions/{session_id}/turns",
        operation_id="take_turn",
        response_class=Response,
        responses={
            **text_response("text/event-stream", "The turn, as Server-Sent Events.", _TURN_EVENT),
            **voice_errors(400, 401, 404, 409, 413, 429),
        },
        openapi_extra={"requestBody": _TURN_BODY},
    )
    async def turn(session_id: str, request: Request) -> Response:
        """The tutor's reply as Server-Sent Events, then a `final` event. The learner's message
        is JSON text, or speech (`multipart/form-data` with `file`)."""
        spoken = None
        try:
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                if voice is None:
                    raise APIError(501, "this server has no voice", code="voice_unavailable")
                course = (await service.session(session_id))["course"]  # 404 before any ASR
                maths = service.courses[course].subject == "math"
                spoken = await read_voice_turn(voice, request, maths=maths)
                message = spoken.message
            else:
                message = (await _text_turn(request)).message
            events = await service.start_turn(session_id, message)
        except KeyError as e:
            raise _not_found(e, "session_id") from e
        except SessionBusyError as e:
            raise APIError(409, str(e), param="session_id", code="session_busy") from e
        except QuotaExceeded as e:
            return JSONResponse(
                error_body(str(e), "rate_limit_error", None, "quota_exceeded"),
                429,
                headers={"Retry-After": str(e.retry_after)},
            )
        if spoken is not None and voice is not None:
            events = voice.turn_events(
                events, spoken.transcript, speak=spoken.speak, voice=spoken.voice,
                message=spoken.message,
            )  # fmt: skip
        return StreamingResponse(
            _sse(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    @router.get(
        "/learners/{learner_id}", operation_id="get_learner", responses=error_responses(401, 404)
    )
    async def learner(learner_id: str) -> dict[str, Any]:
        """Sessions, per-KC mastery and error counts, and a CEFR estimate for language courses."""
        try:
            return await service.learner(learner_id)
        except KeyError as e:
            raise _not_found(e, "learner_id") from e

    return router


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for event in events:
        name = event.pop("event")
        yield f"event: {name}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
