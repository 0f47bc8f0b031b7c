"""Audio bytes in any container a client sends (WAV from tools, WebM/Opus or Ogg from a
browser's MediaRecorder) to 16 kHz mono float32, the one format Whisper takes; and PCM back out
as WAV. Bad input is an AudioError with the HTTP status it deserves, never a crash."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np

SAMPLE_RATE = 16_000  # Whisper's
MAX_SECONDS = 30.0  # one Whisper window; a spoken answer longer than this is not an answer


class AudioError(ValueError):
    status = 400


class AudioTooLong(AudioError):
    status = 413


def decode(data: bytes, max_seconds: float = MAX_SECONDS) -> np.ndarray:
    """16 kHz mono float32 in [-1, 1]; AudioError if empty, undecodable or silent-empty,
    AudioTooLong past `max_seconds` (decoding stops there, so a tiny file that expands to hours
    costs no more than `max_seconds` of work)."""
    if not data:
        raise AudioError("the audio file is empty")
    samples = _plain_wav(data)
    if samples is None:
        samples = _with_av(data, max_seconds)
    if samples.size == 0:
        raise AudioError("the audio file holds no samples")
    if samples.size > max_seconds * SAMPLE_RATE:
        raise AudioTooLong(f"the audio is longer than {max_seconds:g} s")
    return samples


def _plain_wav(data: bytes) -> np.ndarray | None:
    """Integer-PCM WAV with the standard library (no PyAV needed); None for anything else."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    try:
        with wave.open(io.BytesIO(data)) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError, struct.error):
        return None  # float WAV, WAVE_FORMAT_EXTENSIBLE and friends: PyAV knows them
    if width not in (1, 2, 4) or channels < 1 or rate < 1000:
        return None
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
    pcm = np.frombuffer(raw[: len(raw) - len(raw) % (width * channels)], dtype)
    x = pcm.astype(np.float32)
    x = (x - 128) / 128 if width == 1 else x / float(np.iinfo(dtype).max)
    return resample(x.reshape(-1, channels).mean(axis=1), rate, SAMPLE_RATE)


def _with_av(data: bytes, max_seconds: float) -> np.ndarray:
    try:
        import av
    except ImportError as e:  # the voice extra brings PyAV (faster-whisper depends on it)
        raise AudioError("only PCM WAV can be decoded without the voice extra") from e
    limit = int(max_seconds * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioError("the file has no audio stream")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().reshape(-1)
                    chunks.append(chunk)
                    total += chunk.size
                if total > limit:
                    raise AudioTooLong(f"the audio is longer than {max_seconds:g} s")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except AudioError:
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError) as e:
        raise AudioError(f"the audio could not be decoded ({type(e).__name__})") from e
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)


def resample(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Linear interpolation: enough for speech going into Whisper or out to a speaker, and
    needs nothing beyond numpy."""
    if src == dst or x.size == 0:
        return x.astype(np.float32, copy=False)
    n = max(1, round(x.size * dst / src))
    return np.interp(np.arange(n) * (src / dst), np.arange(x.size), x).astype(np.float32)


def to_pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def wav_bytes(pcm16: bytes, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm16)
    return buf.getvalue()


def streaming_wav_header(rate: int) -> bytes:
    """A WAV header for a stream of unknown length (sizes 0xFFFFFFFF, as ffmpeg writes when it
    cannot seek back), so the first sentence's audio can leave before the last is made."""
    unknown = 0xFFFFFFFF
    return (
        b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data" + struct.pack("<I", unknown)
    )  # fmt: skip
