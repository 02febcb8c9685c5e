"""The chat page (`/`) in chromium against a real ``orcapod up`` (no keys):
streaming, Stop, the whole history in every generate, a dropped socket and a
reload resumed in place with no token twice, output shown only as text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Locator, Page, WebSocketRoute, expect
from websockets.sync.client import connect

from tests.browser.conftest import record_banner, start_up

pytestmark = pytest.mark.model

STORY = "Write a long story about a dragon who learns to bake bread."
RESUMED_QUESTION = "List ten animals that live in the ocean, one per line."
RESUMED_MAX_TOKENS = 48
FINISHED = re.compile("^(stop|length)$")


@pytest.fixture(scope="module")
def port(browser: Browser) -> Iterator[int]:
    up, port = start_up()
    yield port
    up.stop()


def last_answer(page: Page) -> Locator:
    return page.locator("article.assistant").last


def answer_text(page: Page) -> str:
    return str(last_answer(page).locator(".text").text_content())


def wait_for_text(page: Page, num_chars: int) -> None:
    page.wait_for_function(
        """n => {
            const answers = document.querySelectorAll("article.assistant .text");
            return answers.length > 0 && answers[answers.length - 1].textContent.length >= n;
        }""",
        arg=num_chars,
    )


def ask(page: Page, question: str, temperature: str, max_tokens: str) -> None:
    page.eval_on_selector("#settings", "details => { details.open = true; }")
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")


def sent_frames(page: Page) -> list[dict]:
    """Every frame the page will send on any of its websockets, parsed."""
    frames: list[dict] = []
    page.on(
        "websocket",
        lambda socket: socket.on("framesent", lambda payload: frames.append(json.loads(payload))),
    )
    return frames


def greedy_answer(url: str, question: str, max_tokens: int) -> str:
    """The answer at temperature 0, straight from the websocket protocol."""
    with connect(url) as socket:
        socket.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "reference",
                    "messages": [{"role": "user", "content": question}],
                    "temperature": 0,
                    "max_tokens": max_tokens,
                }
            )
        )
        text = []
        while True:
            frame = json.loads(socket.recv(timeout=60))
            if frame["type"] == "token":
                text.append(frame["text"])
            elif frame["type"] == "done":
                return "".join(text)
            elif frame["type"] == "error":
                raise AssertionError(frame)


def test_answers_stream_keep_the_conversation_and_stop_cancels(
    page: Page, port: int, screenshots: Path
) -> None:
    frames = sent_frames(page)
    page.goto(f"http://127.0.0.1:{port}/")
    ask(page, "What is the capital of France?", "0", "24")
    answer = last_answer(page)
    expect(answer).to_have_attribute("data-finish", FINISHED)
    expect(answer.locator(".meta")).to_contain_text("TTFT")
    expect(answer.locator(".meta")).to_contain_text("tokens/s")
    first_answer = answer_text(page)
    assert "Paris" in first_answer

    ask(page, STORY, "0.7", "400")
    wait_for_text(page, 10)
    grown_from = len(answer_text(page))
    wait_for_text(page, grown_from + 60)  # the answer streams: its text grows
    expect(page.locator("#send")).to_be_disabled()
    page.click("#stop")
    answer = last_answer(page)
    expect(answer).to_have_attribute("data-finish", "cancelled")
    expect(answer.locator(".meta")).to_contain_text("cancelled")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#banner")).to_be_hidden()

    generates = [frame for frame in frames if frame["type"] == "generate"]
    assert [len(frame["messages"]) for frame in generates] == [1, 3]
    assert generates[1]["messages"][:2] == [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first_answer},
    ]
    assert generates[1]["temperature"] == 0.7 and generates[1]["max_tokens"] == 400
    cancels = [frame for frame in frames if frame["type"] == "cancel"]
    assert cancels == [{"type": "cancel", "id": generates[1]["id"]}]
    page.screenshot(path=str(screenshots / "chat.png"))


def test_a_dropped_socket_and_a_reload_resume_the_answer_in_place(page: Page, port: int) -> None:
    reference = greedy_answer(f"ws://127.0.0.1:{port}/ws", RESUMED_QUESTION, RESUMED_MAX_TOKENS)
    frames = sent_frames(page)
    page.goto(f"http://127.0.0.1:{port}/")

    # The socket drops mid-answer: a banner, a reconnect, a resume, the same answer.
    ask(page, RESUMED_QUESTION, "0", str(RESUMED_MAX_TOKENS))
    wait_for_text(page, 12)
    record_banner(page)
    page.evaluate("window.orcapodChat.dropConnection()")
    expect(last_answer(page)).to_have_attribute("data-finish", FINISHED)
    expect(page.locator("#banner")).to_be_hidden()
    assert any("reconnecting…" in text for text in page.evaluate("window.bannerTexts"))
    assert answer_text(page) == reference
    assert page.locator("article.assistant").count() == 1

    # The page reloads mid-answer: the conversation comes back and the answer goes on.
    page.click("#new-chat")
    ask(page, RESUMED_QUESTION, "0", str(RESUMED_MAX_TOKENS))
    wait_for_text(page, 12)
    page.reload()
    expect(last_answer(page)).to_have_attribute("data-finish", FINISHED)
    assert answer_text(page) == reference
    assert page.locator("article.user").count() == 1
    assert page.locator("article.assistant").count() == 1

    resumes = [frame for frame in frames if frame["type"] == "resume"]
    generates = [frame for frame in frames if frame["type"] == "generate"]
    assert len(resumes) == 2 and len(generates) == 2
    for resume, generate in zip(resumes, generates, strict=True):
        assert resume["id"] == generate["id"]
        assert 0 <= resume["after_seq"] < RESUMED_MAX_TOKENS - 1


HOSTILE = '<b>x</b><script>window.injected = 1</script><img src=x onerror="window.injected = 2">'


def test_model_output_and_server_text_are_shown_as_text(page: Page, port: int) -> None:
    def serve(socket: WebSocketRoute) -> None:
        def answer(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame["type"] != "generate":
                return
            request = frame["id"]
            for reply in (
                {"type": "accepted", "id": request, "request_id": "r1"},
                {"type": "token", "id": request, "seq": 0, "text": HOSTILE[:20], "token_id": 1},
                {"type": "token", "id": request, "seq": 1, "text": HOSTILE[20:], "token_id": 2},
                {"type": "token", "id": request, "seq": 1, "text": "again", "token_id": 2},
                {
                    "type": "done",
                    "id": request,
                    "finish_reason": "stop",
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2},
                    "timings": {"ttft_ms": 12.0, "total_ms": 40.0},
                },
                {"type": "error", "code": "internal", "message": "<i>boom</i>"},
            ):
                socket.send(json.dumps(reply))

        socket.on_message(answer)

    page.route_web_socket("**/ws", serve)
    page.goto(f"http://127.0.0.1:{port}/")
    page.fill("#prompt", "<u>my question</u>")
    page.press("#prompt", "Enter")
    expect(last_answer(page)).to_have_attribute("data-finish", "stop")
    assert answer_text(page) == HOSTILE  # whole, once, as typed
    expect(page.locator("article.user .text")).to_have_text("<u>my question</u>")
    expect(page.locator(".notice")).to_have_text("internal: <i>boom</i>")
    expect(last_answer(page).locator(".meta")).to_have_text(
        "TTFT 12 ms · 35.7 tokens/s · 2 tokens · finished"
    )
    assert page.locator("#log b, #log script, #log img, #log i, #log u").count() == 0
    assert page.evaluate("window.injected") is None
