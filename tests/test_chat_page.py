"""The chat page at `/`, in a real browser: Debian's chromium, driven headless by Playwright.

`minillm serve --api-key` runs in a process of its own. The page must ask for the key, stream a
greedy answer equal to the API's own (same messages, temperature 0, same max_tokens), show the
stream's TTFT/TPOT, stop a long answer (the server's running count falls back to 0 and its KV
blocks are freed), and fit a phone's screen. The screenshot it saves is the README's.
"""
import shutil
import time
from pathlib import Path

import httpx
import pytest

from serve_process import serve_process

pytestmark = pytest.mark.slow

KEY = "page-key"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "chat_page.png"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed: `make browser` installs it")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium browser: `make browser` installs Debian's (apt-get, as root)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])  # root in CI: no sandbox
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(smollm2_path):
    with serve_process(smollm2_path, "--api-key", KEY, kv_cache_bytes=64 << 20) as (process, url):
        yield url


def server_metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    (line,) = [line for line in text.splitlines() if line.startswith(f"minillm:{name}{{")]
    return float(line.rsplit(" ", 1)[1])


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def test_the_chat_page_in_a_browser(browser, server):
    page = browser.new_page(viewport={"width": 900, "height": 720})
    page.goto(server + "/")
    # the server wants a key: the page says so and opens its settings
    page.locator(".error").filter(has_text="Error 401").wait_for()
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    page.locator("#model").filter(has_text="SmolLM2").wait_for()

    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")
    answer = page.locator(".assistant").nth(0)
    answer.and_(page.locator("[data-done]")).wait_for(timeout=120_000)
    shown = answer.locator(".content").inner_text()

    model = page.inner_text("#model")
    api = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                     json={"model": model, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
                           "top_p": 0.9, "max_tokens": 24}).json()
    assert shown == api["choices"][0]["message"]["content"] != ""
    stats = answer.locator(".stats").inner_text()
    assert "TTFT" in stats and "tok/s" in stats and f"{api['usage']['completion_tokens']} tokens" in stats

    # a long answer, stopped: the server aborts it and frees its blocks
    page.fill("#max-tokens", "400")
    page.fill("#prompt", "Tell me a very long story about a dragon.")
    page.click("#send")
    story = page.locator(".assistant").nth(1)
    wait_until(lambda: len(story.locator(".content").inner_text()) > 20, "the story streams")
    assert server_metric(server, "num_requests_running") == 1
    page.click("#stop")
    story.and_(page.locator('[data-done="stopped"]')).wait_for()
    wait_until(lambda: server_metric(server, "num_requests_running") == 0, "running falls back to 0")
    wait_until(lambda: server_metric(server, "kv_cache_usage_perc") == 0, "KV usage falls back to 0")
    page.locator("#server").filter(has_text="running 0").wait_for()  # the page's own reading of /metrics

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))

    # a phone: nothing wider than the screen, the composer still there
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    assert page.locator("#send").is_visible() and page.locator("#prompt").is_visible()
    page.close()
