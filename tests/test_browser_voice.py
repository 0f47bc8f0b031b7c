"""The tutor page's microphone in a real headless Chromium whose microphone is a WAV file of
espeak-ng speech (Chromium's fake capture device): push-to-talk and hands-free spoken turns, the
transcript shown, the reply played; the grammar course's check-the-transcript mode; and no
microphone when the server has no voice."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from conftest import LiveServer, start_server
from test_browser import CHROMIUM, CHROMIUM_ARGS
from tutorserve.voice.audio import resample, to_pcm16, wav_bytes
from tutorserve.voice.tts import EspeakTTS

ESPEAK = shutil.which("espeak-ng")
SPOKEN = "the answer is two and three"


@pytest.fixture(scope="module")
def mic_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Half a second of quiet, the answer, then two seconds of quiet (Chromium loops the file;
    the pause is what hands-free listening waits for)."""
    tts = EspeakTTS(ESPEAK or "espeak-ng")
    speech = resample(tts.synthesize(SPOKEN) / 32768, tts.sample_rate, 48_000)
    quiet = np.zeros(24_000, np.float32)
    path = tmp_path_factory.mktemp("mic") / "answer.wav"
    path.write_bytes(
        wav_bytes(to_pcm16(np.concatenate([quiet, speech, quiet, quiet, quiet])), 48_000)
    )
    return path


@pytest.fixture(scope="module")
def browser(mic_wav: Path) -> Iterator[Browser]:
    args = [
        *CHROMIUM_ARGS,
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={mic_wav}",
        "--autoplay-policy=no-user-gesture-required",
    ]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1000, "height": 720})
    context.set_default_timeout(30_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert errors == [], f"uncaught errors in the page: {errors}"


@pytest.fixture(scope="module")
def server(synth_llama_long: str) -> Iterator[LiveServer]:
    s = start_server(synth_llama_long)
    try:
        yield s
    finally:
        s.stop()


def _open(page: Page, server: LiveServer, course: str) -> None:
    page.goto(server.url + "/")
    page.locator("#learner").fill(f"voice-{course}")
    page.locator(f'.course[data-course="{course}"]').click()
    expect(page.locator("#mic")).to_be_enabled()


def _check_spoken_turn(page: Page) -> None:
    mine = page.locator("#log .msg.user").last
    expect(mine).to_have_attribute("data-voice", "heard", timeout=60_000)
    heard = (mine.text_content() or "").lower()
    # Through Opus and the fake device Whisper may mishear the numbers ("to and free").
    assert "the answer is" in heard, heard
    expect(page.locator("#log .heard")).to_contain_text("may tidy up your grammar")
    reply = page.locator("#log .msg.assistant").last
    expect(reply).to_have_attribute("data-done", "true", timeout=60_000)
    expect(reply.locator(".badge")).not_to_be_empty()
    expect(page.locator(".msg.error")).to_have_count(0)
    # The reply came back as audio, and the page played it.
    # (A sentence's audio may come after the final event: synthesis runs beside the reply.)
    expect(reply).to_have_attribute("data-audio", re.compile(r"^[1-9]"), timeout=30_000)
    expect(reply).to_have_attribute("data-played", re.compile(r"^[1-9]"), timeout=30_000)


def test_push_to_talk_completes_a_spoken_turn(page: Page, server: LiveServer) -> None:
    _open(page, server, "algebra")
    expect(page.locator("#confirm")).not_to_be_checked()  # maths: meaning, not morphology
    mic = page.locator("#mic")
    mic.click()
    expect(mic).to_have_attribute("aria-pressed", "true")
    page.wait_for_timeout(3500)  # the answer is about 2.5 s, after half a second of quiet
    with page.expect_response("**/turns") as resp:
        mic.click()
    assert resp.value.status == 200
    assert "multipart/form-data" in (resp.value.request.headers.get("content-type") or "")
    expect(mic).to_have_attribute("aria-pressed", "false")
    _check_spoken_turn(page)


def test_hands_free_stops_at_the_pause(page: Page, server: LiveServer) -> None:
    _open(page, server, "algebra")
    page.locator("#handsfree").check()
    with page.expect_response("**/turns", timeout=20_000):
        page.locator("#mic").click()  # and nothing more: the pause after the answer ends it
    _check_spoken_turn(page)
    # Once the reply has been spoken, it listens for the next answer; turning hands-free off
    # drops that recording without sending it.
    mic = page.locator("#mic")
    expect(mic).to_have_attribute("aria-pressed", "true", timeout=60_000)
    page.locator("#handsfree").uncheck()
    expect(mic).to_have_attribute("aria-pressed", "false")
    page.wait_for_timeout(500)
    expect(page.locator("#log .msg.user")).to_have_count(1)


def test_grammar_course_shows_the_transcript_before_grading(page: Page, server: LiveServer) -> None:
    _open(page, server, "english-b1")
    expect(page.locator("#confirm")).to_be_checked()
    mic = page.locator("#mic")
    mic.click()
    page.wait_for_timeout(3500)
    with page.expect_response("**/v1/audio/transcriptions") as resp:
        mic.click()
    assert resp.value.status == 200
    # Nothing is graded yet: the transcript waits in the box for the learner to correct.
    expect(page.locator("#input")).to_have_attribute("data-heard", "true")
    heard = page.locator("#input").input_value().lower()
    assert "the answer is" in heard, heard
    expect(page.locator("#log .msg.user")).to_have_count(0)


def test_no_microphone_without_voice(page: Page, synth_llama_long: str) -> None:
    quiet = start_server(synth_llama_long, env={"TUTORSERVE_VOICE": "off"})
    try:
        page.goto(quiet.url + "/")
        expect(page.locator(".course").first).to_be_visible()
        page.locator('.course[data-course="algebra"]').click()
        expect(page.locator("#send")).to_be_enabled()
        expect(page.locator("#mic")).to_be_hidden()
        expect(page.locator("#voice-opts")).to_be_hidden()
    finally:
        quiet.stop()
