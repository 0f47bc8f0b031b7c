"""Spoken tutoring turns, end of speech → first audio byte, on the real engine, in process, at
several numbers of concurrent spoken sessions.

Each simulated learner says (espeak-ng, 16 kHz WAV) a known mistake and then the right answer to
each of the first problems of both courses, one course after the other. The clock starts when
the utterance is complete (what a client sends once it hears silence) and stops at the first
sentence of the reply as audio. Stages:
ASR (decode + Whisper), first sentence (the turn until the text of its first sentence is
released: diagnosis, and for a question the model's first sentence), TTS (synthesising it).
Also recorded: whether Whisper heard the answer as said, the tutor's concern with learner speech.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tutorserve.config import EngineConfig
from tutorserve.engine.async_engine import AsyncEngine
from tutorserve.engine.engine import LLMEngine
from tutorserve.server.audio import Voice, as_message
from tutorserve.tutor.courses import Course, load_courses
from tutorserve.tutor.llm_client import EngineLLM
from tutorserve.tutor.service import TutorService
from tutorserve.tutor.store import TutorStore
from tutorserve.voice.audio import SAMPLE_RATE, resample, to_pcm16, wav_bytes

GOAL_S = 1.5
STAGES = ("asr_ms", "first_sentence_ms", "tts_ms")


@dataclass(slots=True)
class VoiceSample:
    sessions: int
    course: str
    said: str
    heard: str
    mistake: bool  # a known wrong answer was said
    asr_ms: float
    first_sentence_ms: float
    tts_ms: float
    total_ms: float
    first_audio_text: str


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _speak(voice: Voice, text: str) -> bytes:
    tts = voice.need_tts()
    pcm = tts.synthesize(text)
    return wav_bytes(to_pcm16(resample(pcm / 32768, tts.sample_rate, SAMPLE_RATE)), SAMPLE_RATE)


def _script(course: Course, problems: int) -> list[tuple[str, bool]]:
    """(answer, is a known mistake) for the course's first problems."""
    out = []
    for p in course.problems[:problems]:
        if p.misconceptions:
            out.append((p.misconceptions[0].answer, True))
        out.append((p.answer, False))
    return out


async def _learner(
    service: TutorService, voice: Voice, courses: list[Course], name: str, scripts: dict,
    audio: dict, sessions: int, bar: tqdm,
) -> list[VoiceSample]:  # fmt: skip
    """One learner working through each of `courses` in turn, a session each."""
    out = []
    for course in courses:
        session = await service.start_session(name, course.id)
        out += await _session(service, voice, course, session["id"], scripts[course.id], audio,
                              sessions, bar)  # fmt: skip
    return out


async def _session(
    service: TutorService, voice: Voice, course: Course, session_id: str, script: list,
    audio: dict, sessions: int, bar: tqdm,
) -> list[VoiceSample]:  # fmt: skip
    out = []
    for said, mistake in script:
        t0 = time.monotonic()  # end of speech: the whole utterance is here
        transcript = await voice.transcribe(audio[said])
        t_asr = time.monotonic()
        if not transcript.text:  # nothing heard: no turn, as a client would not send one
            bar.update()
            continue
        message = as_message(transcript.text, course.subject == "math")
        events = await service.start_turn(session_id, message)
        first: tuple[float, float, str] | None = None
        async for event in voice.turn_events(
            events, transcript, speak=True, binary=True, message=message
        ):
            if event["event"] == "audio" and first is None:
                first = (time.monotonic(), event["tts_ms"], event["text"])
        bar.update()
        if first is None:
            continue
        total = (first[0] - t0) * 1e3
        asr = (t_asr - t0) * 1e3
        out.append(
            VoiceSample(
                sessions=sessions, course=course.id, said=said, heard=message,
                mistake=mistake, asr_ms=round(asr, 1),
                first_sentence_ms=round(total - asr - first[1], 1), tts_ms=first[1],
                total_ms=round(total, 1), first_audio_text=first[2],
            )
        )  # fmt: skip
    return out


async def _run(model: str, levels: list[int], problems: int, options: dict) -> list[VoiceSample]:
    voice = Voice.from_env()
    voice.need_asr()
    voice.need_tts()
    courses = load_courses()
    scripts = {c.id: _script(c, problems) for c in courses.values()}
    sentences = {s for script in scripts.values() for s, _ in script}
    audio = {s: _speak(voice, s) for s in sentences}
    await voice.transcribe(audio[next(iter(sentences))])  # loads Whisper (not timed)
    config = EngineConfig.from_kwargs(model=model, **options)
    server = AsyncEngine(lambda: LLMEngine(config))
    await server.start()
    samples: list[VoiceSample] = []
    with tempfile.TemporaryDirectory() as d:
        store = TutorStore(f"sqlite:///{d}/bench.db")
        service = TutorService(courses, store, EngineLLM(server, model))
        try:
            # One untimed turn per course: the engine's first steps and the course prefixes.
            for c in courses.values():
                s = await service.start_session(f"warm-{c.id}", c.id)
                async for _ in await service.start_turn(s["id"], "I am not sure"):
                    pass
            cs = list(courses.values())
            total = sum(n * sum(map(len, scripts.values())) for n in levels)
            with tqdm(total=total, desc="spoken turns", unit="turn") as bar:
                for n in levels:
                    # Every learner takes both courses, half of them in the other order, so
                    # each level mixes them (one learner alone too).
                    runs = await asyncio.gather(*(
                        _learner(service, voice, cs[i % 2 :] + cs[: i % 2], f"voice-{n}-{i}",
                                 scripts, audio, n, bar)
                        for i in range(n)
                    ))  # fmt: skip
                    samples += [s for run in runs for s in run]
        finally:
            await service.close()
            await server.stop()
    return samples


def run_voice_bench(
    model: str, levels: list[int], problems: int, options: dict[str, Any]
) -> list[VoiceSample]:
    return asyncio.run(_run(model, levels, problems, options))


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def table(samples: list[VoiceSample]) -> str:
    rows = [
        "| sessions | turns | p50 s | p90 s | ≤ 1.5 s | ASR p50 ms | first sentence p50 ms "
        "| TTS p50 ms | shares ASR / sentence / TTS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in sorted({s.sessions for s in samples}):
        g = [s for s in samples if s.sessions == n]
        totals = [s.total_ms for s in g]
        med = {k: statistics.median(getattr(s, k) for s in g) for k in STAGES}
        whole = sum(med.values()) or 1
        within = sum(t <= GOAL_S * 1e3 for t in totals) / len(g)
        rows.append(
            f"| {n} | {len(g)} | {_pct(totals, 0.5) / 1e3:.2f} | {_pct(totals, 0.9) / 1e3:.2f} "
            f"| {within:.0%} | {med['asr_ms']:.0f} | {med['first_sentence_ms']:.0f} "
            f"| {med['tts_ms']:.0f} | "
            + " / ".join(f"{med[k] / whole:.0%}" for k in STAGES) + " |"
        )  # fmt: skip
    return "\n".join(rows)


def heard_table(samples: list[VoiceSample]) -> str:
    """How often Whisper heard the answer as said, and how often a mistake came out right."""
    rows = ["| course | answers said | heard word for word | a mistake heard as another form |",
            "|---|---|---|---|"]  # fmt: skip
    for course in sorted({s.course for s in samples}):
        g = [s for s in samples if s.course == course]
        same = sum(_words(s.said) == _words(s.heard) for s in g)
        wrong = [s for s in g if s.mistake]
        changed = sum(_words(s.said) != _words(s.heard) for s in wrong)
        rows.append(f"| {course} | {len(g)} | {same} | {changed} of {len(wrong)} |")
    return "\n".join(rows)


def plot(samples: list[VoiceSample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({s.sessions for s in samples})
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(levels)
    for key, color, label in zip(STAGES, ("#2f6fde", "#d98a1c", "#2e9d5b"),
                                 ("ASR", "first sentence", "TTS"), strict=True):  # fmt: skip
        vals = [statistics.median(getattr(s, key) for s in samples if s.sessions == n) / 1e3
                for n in levels]  # fmt: skip
        ax.bar([str(n) for n in levels], vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for q, color, name in ((0.5, "#1d2433", "p50 (whole turn)"), (0.9, "#8a1c1c", "p90")):
        at = [_pct([s.total_ms for s in samples if s.sessions == n], q) / 1e3 for n in levels]
        ax.scatter([str(n) for n in levels], at, color=color, marker="_", s=600, label=name)
    ax.axhline(GOAL_S, color="#999", ls="--", lw=1, label="goal p50 1.5 s")
    ax.set(xlabel="concurrent spoken sessions", ylabel="end of speech → first audio (s)",
           title="spoken turns: median of each stage; p50 and p90 of the whole")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def as_json(samples: list[VoiceSample]) -> dict[str, Any]:
    return {"turns": [asdict(s) for s in samples]}
