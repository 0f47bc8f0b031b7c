"""The tutor's spoken turns over a WebSocket, for the lowest latency: the learner's speech
streams in while they talk, and the reply streams back as text and audio, sentence by sentence.

`/v1/tutor/sessions/{id}/voice?rate=16000[&partials=true][&voice=alloy][&api_key=KEY]`.
Client → server: binary frames of 16-bit little-endian mono PCM at `rate`; a text frame
`{"type": "end"}` when the learner stops (push-to-talk released, or the page heard silence).
Server → client: JSON text frames, the same events as the SSE turn (`transcript`, `delta`,
`reset`, `final`, `engage`, `error`) ending with `{"event": "done"}`; each `audio` event's JSON
is followed by one binary frame, that sentence's WAV. With `partials=true`, `{"event":
"partial", "text"}` while the learner speaks (each one a Whisper call over the speech so far:
on two cores it competes with the final transcription, so it is off by default). Browsers cannot
set headers on a WebSocket, hence the key as a query parameter.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from tutorserve.server.audio import Voice, as_message
from tutorserve.server.serving import APIError
from tutorserve.tutor.quotas import QuotaExceeded
from tutorserve.tutor.service import SessionBusyError, TutorService
from tutorserve.voice.audio import MAX_SECONDS, SAMPLE_RATE, resample

log = logging.getLogger(__name__)
PARTIAL_EVERY = 1.5  # seconds of new speech between partial transcripts


def _authorized(ws: WebSocket, key: str | None) -> bool:
    if not key:
        return True
    auth = ws.headers.get("authorization", "")
    given = auth[7:] if auth[:7].lower() == "bearer " else ws.query_params.get("api_key", "")
    return hmac.compare_digest(given.encode(), key.encode())


def voice_socket_router(service: TutorService, voice: Voice, api_key: str | None) -> APIRouter:
    router = APIRouter()

    @router.websocket("/v1/tutor/sessions/{session_id}/voice")
    async def voice_turns(ws: WebSocket, session_id: str) -> None:
        if not _authorized(ws, api_key):
            await ws.close(code=1008, reason="missing or incorrect API key")
            return
        await ws.accept()
        try:
            await _serve(ws, service, voice, session_id)
        except WebSocketDisconnect:
            pass  # a turn already started goes on and is stored (TutorService runs it)
        except APIError as e:  # 501 and friends, before any turn
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await ws.send_json({"event": "error", "status": e.status, **e.body()["error"]})
                await ws.close(code=1011 if e.status >= 500 else 1008)

    return router


async def _serve(ws: WebSocket, service: TutorService, voice: Voice, session_id: str) -> None:
    voice.need_asr()
    name = ws.query_params.get("voice") or None
    tts = voice.need_tts(name)
    try:
        rate = int(ws.query_params.get("rate", SAMPLE_RATE))
    except ValueError:
        rate = 0
    if not 8000 <= rate <= 48000:
        raise APIError(400, "rate must be a sample rate from 8000 to 48000", param="rate")
    partials = ws.query_params.get("partials", "false").lower() == "true"
    try:
        course = (await service.session(session_id))["course"]
    except KeyError as e:
        raise APIError(404, str(e.args[0]), param="session_id", code="not_found") from e
    maths = service.courses[course].subject == "math"
    while True:
        pcm = await _utterance(ws, voice, rate, partials)
        if pcm is None:
            continue
        try:
            transcript = await voice.transcribe(pcm)
        except APIError as e:
            await _fail(ws, e.status, str(e))
            continue
        if not transcript.text:
            await _fail(ws, 400, "no speech was heard")
            continue
        message = as_message(transcript.text, maths)
        try:
            events = await service.start_turn(session_id, message)
        except (KeyError, SessionBusyError) as e:
            await _fail(ws, 404 if isinstance(e, KeyError) else 409, str(e.args[0]))
            continue
        except QuotaExceeded as e:  # as the HTTP route's 429, with its Retry-After
            await ws.send_json({"event": "error", "status": 429, "message": str(e),
                                "retry_after": e.retry_after})  # fmt: skip
            await ws.send_json({"event": "done"})
            continue
        async for event in voice.turn_events(
            events, transcript, speak=tts is not None, voice=name, binary=True, message=message
        ):
            wav = event.pop("wav", None)
            await ws.send_json(event)
            if wav is not None:
                await ws.send_bytes(wav)
        await ws.send_json({"event": "done"})


async def _utterance(ws: WebSocket, voice: Voice, rate: int, partials: bool) -> np.ndarray | None:
    """One utterance's samples at 16 kHz, once the client says it ended; None (after telling
    the client) when it was empty or too long."""
    buf = bytearray()
    limit = int(MAX_SECONDS * rate) * 2
    too_long = False
    heard = 0  # bytes covered by the last partial
    pending: asyncio.Task[Any] | None = None
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            if (data := message.get("bytes")) is not None:
                if len(buf) + len(data) > limit:
                    too_long = True
                else:
                    buf += data
            elif _is_end(message.get("text")):
                break
            due = len(buf) - heard >= PARTIAL_EVERY * rate * 2
            if partials and due and not too_long and (pending is None or pending.done()):
                heard = len(buf)
                pending = asyncio.create_task(_partial(ws, voice, _samples(bytes(buf), rate)))
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    if pending is not None:
        # Whisper runs one call at a time, so the final transcription would wait for this
        # partial anyway; the learner may as well see it.
        await pending
    if too_long or not buf:
        await _fail(
            ws, *((413, f"over {MAX_SECONDS:g} s of audio") if too_long else (400, "no audio"))
        )
        return None
    return _samples(bytes(buf), rate)


async def _fail(ws: WebSocket, status: int, message: str) -> None:
    """This utterance is refused; the socket stays open for the next one."""
    await ws.send_json({"event": "error", "status": status, "message": message})
    await ws.send_json({"event": "done"})


def _is_end(text: str | None) -> bool:
    try:
        return text is not None and json.loads(text).get("type") == "end"
    except (ValueError, AttributeError):
        return False


def _samples(pcm: bytes, rate: int) -> np.ndarray:
    x = np.frombuffer(pcm[: len(pcm) // 2 * 2], "<i2").astype(np.float32) / 32768
    return resample(x, rate, SAMPLE_RATE)


async def _partial(ws: WebSocket, voice: Voice, samples: np.ndarray) -> None:
    try:
        t = await voice.transcribe(samples)
        await ws.send_json({"event": "partial", "text": t.text})
    except (APIError, WebSocketDisconnect, RuntimeError):
        log.debug("partial transcript dropped", exc_info=True)
