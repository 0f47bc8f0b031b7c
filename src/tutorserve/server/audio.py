"""OpenAI's audio routes (`/v1/audio/transcriptions`, `/v1/audio/speech`) and what the tutor's
voice turns share with them: `Voice` holds the recogniser and the synthesizer, or the reason
either is missing (then their routes answer 501 with that reason)."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, File, Form, Request, UploadFile
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile as FormFile
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from tutorserve.server.openapi import error_responses, text_response
from tutorserve.server.protocol import ErrorResponse
from tutorserve.server.serving import APIError
from tutorserve.voice import asr as asr_mod
from tutorserve.voice.asr import Transcriber, Transcript, VoiceUnavailable, asr_missing
from tutorserve.voice.audio import AudioError, decode, resample, streaming_wav_header, to_pcm16
from tutorserve.voice.audio import wav_bytes as make_wav
from tutorserve.voice.speech import Sentences, speak_events
from tutorserve.voice.spoken import spoken_math
from tutorserve.voice.tts import MAX_CHARS, Synthesizer, load_tts

OUT_RATE = 24_000  # OpenAI's rate for `pcm`; our WAVs use it too
TRANSCRIBE_MODELS = {"whisper-1", asr_mod.MODEL_NAME}
SPEECH_MODELS = {"tts-1", "tts-1-hd", "gpt-4o-mini-tts", "espeak-ng", "piper"}
_501 = {
    501: {
        "model": ErrorResponse,
        "description": "Speech is not installed here (the `voice` extra, or espeak-ng).",
    }
}


def voice_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {**error_responses(*codes), **_501}


class Voice:
    def __init__(
        self, asr: Transcriber | None, tts: Synthesizer | None, why_not: dict[str, str]
    ) -> None:
        self.asr, self.tts, self.why_not = asr, tts, why_not

    @classmethod
    def from_env(cls) -> Voice:
        """`TUTORSERVE_VOICE=off` turns speech off; `TUTORSERVE_TTS=piper` picks Piper."""
        if os.environ.get("TUTORSERVE_VOICE", "on").lower() in ("off", "0", "false", "no"):
            off = "speech is turned off on this server (TUTORSERVE_VOICE=off)"
            return cls(None, None, {"asr": off, "tts": off})
        why_not = {}
        if why := asr_missing():
            why_not["asr"] = why
        tts, why = load_tts(os.environ.get("TUTORSERVE_TTS", "espeak"))
        if why:
            why_not["tts"] = why
        return cls(None if "asr" in why_not else Transcriber(), tts, why_not)

    def capabilities(self) -> dict[str, Any]:
        return {
            "asr": self.asr is not None,
            "tts": self.tts is not None,
            "asr_model": asr_mod.MODEL_NAME if self.asr else None,
            "tts_engine": self.tts.name if self.tts else None,
            "voices": list(self.tts.voices) if self.tts else [],
            "max_seconds": 30,
            "reasons": self.why_not,
        }

    def need_asr(self) -> Transcriber:
        if self.asr is None:
            raise APIError(501, self.why_not["asr"], code="voice_unavailable", type_="server_error")
        return self.asr

    def need_tts(self, voice: str | None = None) -> Synthesizer:
        if self.tts is None:
            raise APIError(501, self.why_not["tts"], code="voice_unavailable", type_="server_error")
        if voice is not None and voice not in self.tts.voices:
            raise APIError(
                400, f"unknown voice {voice!r}; available: {', '.join(self.tts.voices)}",
                param="voice", code="invalid_value",
            )  # fmt: skip
        return self.tts

    async def transcribe(self, data: bytes | np.ndarray, language: str | None = None) -> Transcript:
        """Audio bytes (any container) or 16 kHz float samples → text; APIError for bad audio."""
        asr = self.need_asr()
        if language not in (None, "", *asr_mod.LANGUAGES):
            raise APIError(
                400, f"language {language!r} is not supported; this model knows: en",
                param="language", code="invalid_value",
            )  # fmt: skip
        try:
            samples = (
                data if isinstance(data, np.ndarray) else await asyncio.to_thread(decode, data)
            )
            return await asyncio.to_thread(asr.transcribe, samples, "en")
        except AudioError as e:
            raise APIError(e.status, str(e), param="file", code="invalid_audio") from e
        except VoiceUnavailable as e:
            raise APIError(501, str(e), code="voice_unavailable", type_="server_error") from e

    async def sentences_audio(self, text: str, voice: str | None) -> AsyncIterator[bytes]:
        """`text` spoken sentence by sentence: 16-bit PCM at OUT_RATE, one chunk a sentence."""
        tts = self.need_tts(voice)
        split = Sentences()
        for sentence in [*split.feed(text), *split.finish()]:
            pcm = await asyncio.to_thread(tts.synthesize, sentence, voice)
            yield _pcm_out(pcm, tts.sample_rate)

    async def turn_events(
        self,
        events: AsyncIterator[dict[str, Any]],
        transcript: Transcript | None,
        *,
        speak: bool,
        voice: str | None = None,
        binary: bool = False,
        message: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """A voice turn's events: `transcript` first (what was heard, and the `message` graded),
        the final event carrying it, and an `audio` event per sentence (a WAV, base64 in
        `data`; as bytes in `wav` if `binary`)."""
        heard = None if transcript is None else _heard(transcript, message)
        if heard is not None:
            yield {"event": "transcript", **heard}
        if speak:
            events = speak_events(events, self.need_tts(voice), voice)
        async for event in events:
            if event["event"] == "final" and heard is not None:
                event["transcript"] = heard
            elif event["event"] == "audio":
                pcm = event.pop("pcm")
                wav = make_wav(_pcm_out(pcm, event.pop("sample_rate")), OUT_RATE)
                event |= {"format": "wav", "sample_rate": OUT_RATE}
                if binary:
                    event["wav"] = wav
                else:
                    event["data"] = base64.b64encode(wav).decode()
            yield event


def _heard(t: Transcript, message: str | None) -> dict[str, Any]:
    return {
        "text": t.text, "message": message or t.text, "duration": t.duration,
        "asr_ms": round(t.seconds * 1e3, 1),
    }  # fmt: skip


def as_message(transcript: str, maths: bool) -> str:
    """What is graded: the transcript, with spoken maths written as maths in a maths course."""
    return spoken_math(transcript) if maths else transcript


def _pcm_out(pcm: np.ndarray, rate: int) -> bytes:
    return to_pcm16(resample(pcm.astype(np.float32) / 32768, rate, OUT_RATE))


@dataclass(slots=True)
class VoiceTurn:
    transcript: Transcript
    message: str
    speak: bool
    voice: str | None


async def read_voice_turn(voice: Voice, request: Request, *, maths: bool = False) -> VoiceTurn:
    """A turn posted as multipart/form-data: `file` (the learner's speech), optional `speak`
    (true: the reply comes back as audio events too), `voice`, `language`."""
    voice.need_asr()
    form = await request.form(max_files=1, max_fields=8)
    upload = form.get("file")
    if not isinstance(upload, FormFile):  # starlette's, which FastAPI's subclasses
        raise APIError(400, "file: the learner's audio is required", param="file")
    speak = str(form.get("speak", "true")).lower() not in ("false", "0", "no")
    name = form.get("voice")
    name = name if isinstance(name, str) and name else None
    if speak:
        voice.need_tts(name)
    language = form.get("language")
    transcript = await voice.transcribe(
        await upload.read(), language if isinstance(language, str) else None
    )
    if not transcript.text:
        raise APIError(400, "no speech was heard in the audio", param="file", code="no_speech")
    return VoiceTurn(transcript, as_message(transcript.text, maths), speak, name)


class SpeechRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=64)]
    input: Annotated[str, Field(min_length=1, max_length=MAX_CHARS)]
    voice: Annotated[str, Field(min_length=1, max_length=64)] = "alloy"
    response_format: Literal["wav", "pcm"] = "wav"


def audio_router(voice: Voice) -> APIRouter:
    router = APIRouter(prefix="/v1/audio", tags=["audio"])

    @router.get("/capabilities", operation_id="audio_capabilities", responses=error_responses(401))
    async def capabilities() -> dict[str, Any]:
        """Whether this server can listen and speak (the tutor page shows its microphone only
        when it can do both), and why not."""
        return voice.capabilities()

    @router.post(
        "/transcriptions",
        operation_id="create_transcription",
        responses={
            **text_response("text/plain", "The text, for `response_format` text."),
            **voice_errors(400, 401, 404, 413),
        },
    )
    async def transcriptions(
        file: Annotated[UploadFile, File(description="WAV, WebM, Ogg, MP3, FLAC… up to 30 s")],
        model: Annotated[str, Form()],
        language: Annotated[str | None, Form()] = None,
        response_format: Annotated[Literal["json", "text", "verbose_json"], Form()] = "json",
        prompt: Annotated[str | None, Form(description="accepted, not used")] = None,
        temperature: Annotated[float | None, Form(description="accepted, not used")] = None,
    ) -> Any:
        """OpenAI's transcription: speech to text with Whisper tiny.en on the CPU."""
        if model not in TRANSCRIBE_MODELS:
            raise APIError(
                404, f"unknown model {model!r}; available: {', '.join(sorted(TRANSCRIBE_MODELS))}",
                param="model", code="model_not_found",
            )  # fmt: skip
        t = await voice.transcribe(await file.read(), language)
        if response_format == "text":
            return PlainTextResponse(t.text)
        if response_format == "json":
            return {"text": t.text}
        return {
            "task": "transcribe", "language": "english", "duration": t.duration,
            "text": t.text, "segments": t.segments,
        }  # fmt: skip

    @router.post(
        "/speech",
        operation_id="create_speech",
        response_class=Response,
        responses={
            **text_response("audio/wav", "WAV (or raw 24 kHz 16-bit PCM), streamed per sentence"),
            **voice_errors(400, 401, 404, 413),
        },
    )
    async def speech(req: SpeechRequest) -> StreamingResponse:
        """OpenAI's text to speech; the audio streams out a sentence at a time."""
        if req.model not in SPEECH_MODELS:
            raise APIError(
                404, f"unknown model {req.model!r}; available: {', '.join(sorted(SPEECH_MODELS))}",
                param="model", code="model_not_found",
            )  # fmt: skip
        voice.need_tts(req.voice)
        chunks = voice.sentences_audio(req.input, req.voice)

        async def body() -> AsyncIterator[bytes]:
            if req.response_format == "wav":
                yield streaming_wav_header(OUT_RATE)
            async for chunk in chunks:
                yield chunk

        media = "audio/wav" if req.response_format == "wav" else "audio/pcm"
        return StreamingResponse(body(), media_type=media)

    return router
