"""The tutor's HTTP API under /v1/tutor; errors use the OpenAI-style body of the rest of the server.

A turn streams as Server-Sent Events with named events: `delta` (reply text), `reset` (drop the
text shown so far: the answer-leak guard replaced it), `final` (diagnosis, ladder level, mastery
changes, timing), `engage` (a short encouragement computed after `final`), or `error`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import StreamingResponse

from tutorserve.server.serving import APIError
from tutorserve.tutor.service import SessionBusyError, TutorService, UnknownCourseError

_ERRORS: dict[int | str, dict[str, Any]] = {code: {} for code in (400, 404, 409)}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SessionRequest(_Body):
    learner_id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\w.@-]+$")]
    course: Annotated[str, Field(min_length=1, max_length=64)]


class TurnRequest(_Body):
    message: Annotated[str, Field(min_length=1, max_length=4000)]


def _not_found(e: KeyError, param: str) -> APIError:
    return APIError(404, str(e.args[0]), param=param, code="not_found")


def tutor_router(service: TutorService) -> APIRouter:
    router = APIRouter(prefix="/v1/tutor", tags=["tutor"])

    @router.get("/courses")
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

    @router.post("/sessions", responses=_ERRORS)
    async def start_session(req: SessionRequest) -> dict[str, Any]:
        """Start tutoring `learner_id` (created on first use) on `course`."""
        try:
            return await service.start_session(req.learner_id, req.course)
        except UnknownCourseError as e:
            raise APIError(400, str(e), param="course", code="course_not_found") from e

    @router.get("/sessions/{session_id}", responses=_ERRORS)
    async def get_session(session_id: str) -> dict[str, Any]:
        try:
            return await service.session(session_id)
        except KeyError as e:
            raise _not_found(e, "session_id") from e

    @router.post("/sessions/{session_id}/turns", responses=_ERRORS)
    async def turn(session_id: str, req: TurnRequest) -> StreamingResponse:
        """The tutor's reply as Server-Sent Events, then a `final` event."""
        try:
            events = await service.start_turn(session_id, req.message)
        except KeyError as e:
            raise _not_found(e, "session_id") from e
        except SessionBusyError as e:
            raise APIError(409, str(e), param="session_id", code="session_busy") from e
        return StreamingResponse(
            _sse(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    @router.get("/learners/{learner_id}", responses=_ERRORS)
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
