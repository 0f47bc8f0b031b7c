"""The tutor page (`/`) and the plain chat page (`/chat`) in a real headless Chromium, driven
by Playwright.

Uses Debian's Chromium at /usr/bin/chromium (the Makefile installs it); never a Playwright
browser download. A missing browser fails these tests rather than skipping them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from conftest import LiveServer, start_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
API_KEY = "s3cret"

# Before any page script runs: note the last assistant bubble's text length (and state) at
# every DOM change, so a test can tell a streamed reply from one that arrived all at once.
RECORD_GROWTH = """
window.__growth = [];
new MutationObserver(() => {
  const all = document.querySelectorAll("#log .msg.assistant");
  const out = all[all.length - 1];
  if (!out) return;
  window.__growth.push({ len: out.textContent.length, streaming: out.dataset.streaming === "true",
                         done: out.dataset.done === "true", t: performance.now() });
}).observe(document, { subtree: true, childList: true, characterData: true, attributes: true });
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing; install Debian's chromium (make test does)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1000, "height": 720})
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.add_init_script(RECORD_GROWTH)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert errors == [], f"uncaught errors in the page: {errors}"


@pytest.fixture(scope="module")
def keyed_server(synth_llama: str) -> Iterator[LiveServer]:
    server = start_server(synth_llama, "--api-key", API_KEY)
    try:
        yield server
    finally:
        server.stop()


def _ask_and_check_stream(page: Page, text: str) -> str:
    """Send `text` with Enter; check the reply streamed in pieces, finished, and had no error."""
    before = page.locator("#log .msg.assistant").count()
    with page.expect_request("**/v1/chat/completions") as req_info:
        page.locator("#input").fill(text)
        page.locator("#input").press("Enter")
    body = req_info.value.post_data_json
    assert body["model"] == "tiny" and body["stream"] is True
    assert body["messages"][0]["role"] == "system"
    assert body["messages"][-1] == {"role": "user", "content": text}

    expect(page.locator("#log .msg.user").last).to_have_text(text)
    expect(page.locator("#input")).to_have_value("")
    reply = page.locator("#log .msg.assistant").nth(before)
    expect(reply).to_have_attribute("data-done", "true", timeout=25_000)
    expect(reply).not_to_have_attribute("data-streaming", "true")
    expect(page.locator(".msg.error")).to_have_count(0)
    expect(page.locator("#send")).to_have_text("Send")

    final = reply.text_content() or ""
    assert final.strip(), "the assistant bubble is empty"
    growth = page.evaluate("window.__growth")
    seen = [g["len"] for g in growth if g["streaming"] and not g["done"] and g["len"] > 0]
    assert len(set(seen)) > 1, f"the reply did not grow in steps while streaming: {seen}"
    assert seen == sorted(seen), "the reply's text shrank while streaming"
    assert max(seen) <= len(final)
    return final


def test_page_streams_a_reply(page: Page, live_server: LiveServer) -> None:
    console_errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
    page.goto(live_server.url + "/chat")
    expect(page.locator("#model")).to_have_text(live_server.model)
    expect(page.locator("#key")).to_be_hidden()
    expect(page.locator("#input")).to_be_focused()

    _ask_and_check_stream(page, "What is 7 times 8?")
    assert console_errors == []


def test_page_asks_for_the_api_key(page: Page, keyed_server: LiveServer) -> None:
    page.goto(keyed_server.url + "/chat")
    key_bar = page.locator("#key")
    expect(key_bar).to_be_visible()
    expect(page.locator("#key-input")).to_be_focused()
    expect(page.locator("#model")).to_have_text("connecting…")

    # A wrong key: the server says 401 and the bar stays.
    with page.expect_response("**/v1/models") as resp_info:
        page.locator("#key-input").fill("wrong")
        page.locator("#key-save").click()
    assert resp_info.value.status == 401
    assert resp_info.value.request.headers["authorization"] == "Bearer wrong"
    page.wait_for_timeout(300)  # let the page handle the 401 before checking nothing changed
    expect(key_bar).to_be_visible()
    expect(page.locator("#model")).to_have_text("connecting…")

    # The right key: the bar goes, the model appears, and a chat streams with the key.
    with page.expect_response("**/v1/models") as resp_info:
        page.locator("#key-input").fill(API_KEY)
        page.locator("#key-save").click()
    assert resp_info.value.status == 200
    expect(key_bar).to_be_hidden()
    expect(page.locator("#model")).to_have_text(keyed_server.model)
    with page.expect_response("**/v1/chat/completions") as chat_info:
        _ask_and_check_stream(page, "Why is the sky blue?")
    assert chat_info.value.status == 200
    assert chat_info.value.request.headers["authorization"] == f"Bearer {API_KEY}"

    # The key lasts for the tab's session: a reload connects without asking again.
    page.reload()
    expect(page.locator("#model")).to_have_text(keyed_server.model)
    expect(key_bar).to_be_hidden()


@pytest.fixture(scope="module")
def tutor_server(synth_llama_long: str) -> Iterator[LiveServer]:
    server = start_server(synth_llama_long)
    try:
        yield server
    finally:
        server.stop()


def _answer(page: Page, text: str, level: str) -> None:
    """Send `text`; the reply streams, ends with the ladder badge `level`, and has no error."""
    before = page.locator("#log .msg.assistant").count()
    page.locator("#input").fill(text)
    with page.expect_response("**/turns"):
        page.locator("#input").press("Enter")
    reply = page.locator("#log .msg.assistant").nth(before)
    expect(reply).to_have_attribute("data-done", "true", timeout=60_000)
    expect(reply.locator(".badge")).to_have_text(level)
    expect(reply.locator(".body")).not_to_be_empty()
    expect(page.locator(".msg.error")).to_have_count(0)
    growth = page.evaluate("window.__growth")
    assert any(g["streaming"] and g["len"] > 0 for g in growth), "nothing showed while streaming"


def _mastery(page: Page, kc: str) -> float:
    return float(page.locator(f'#mastery .kc[data-kc="{kc}"]').get_attribute("data-p") or "nan")


def test_tutor_page_climbs_the_ladder_and_moves_the_mastery_bars(
    page: Page, tutor_server: LiveServer
) -> None:
    page.goto(tutor_server.url + "/")
    expect(page.locator("#model")).to_have_text(tutor_server.model)
    page.locator("#learner").fill("playwright")
    page.locator('.course[data-course="algebra"]').click()
    expect(page.locator("#problem")).to_contain_text("x^2 - 5x + 6 = 0")
    expect(page.locator('.course[data-course="algebra"]')).to_have_attribute("aria-pressed", "true")
    bar = page.locator('#mastery .kc[data-kc="factoring"]')
    expect(bar.locator(".pct")).to_have_text(f"{round(_mastery(page, 'factoring') * 100)}%")
    start = _mastery(page, "factoring")

    _answer(page, "x = 1 or x = 6", "hint")
    after_one = _mastery(page, "factoring")
    assert after_one < start
    expect(bar.locator(".errs")).to_have_text("1 attempt, 1 error")
    _answer(page, "x = 5", "guiding question")
    assert _mastery(page, "factoring") < after_one
    width = bar.locator(".fill").evaluate("e => e.style.width")
    assert width == f"{round(_mastery(page, 'factoring') * 100)}%"

    _answer(page, "x = 2 or x = 3", "confirmation")
    assert _mastery(page, "factoring") > after_one
    expect(page.locator("#problem")).not_to_contain_text("x^2 - 5x + 6 = 0")
    # Each encouragement sits under its own reply, though it arrives after the final event.
    expect(page.locator("#log .msg.assistant + .engage")).to_have_count(3)
