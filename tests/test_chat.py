"""`orcapod chat`: its pure pieces, its refusals of a bad URL, and a user at a terminal:
the real client in a pseudo-terminal against a real gateway (real redis-server, real
tokenizer), the test playing the scheduler and the worker."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import re
import subprocess
import sys
import termios
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from orcapod.chat import AnswerSpeed, BadUrlError, answer_speed, describe_speed, websocket_url
from tests.conftest import RedisServer
from tests.gateway.test_server import running_gateway
from tests.gateway.worker_tokens import worker_tokens
from tests.up_process import REPO

EXPECT_TIMEOUT_S = 5.0
SPEED_LINE = re.compile(
    r"\[ttft (?P<ttft_s>\d+\.\d\d) s(?: · (?P<tokens_per_s>\d+\.\d) tok/s)?"
    r" · (?P<num_tokens>\d+) tokens?\]"
)


def test_answer_speed_without_tokens_or_with_one_divides_by_nothing():
    assert answer_speed(10.0, []) == AnswerSpeed(num_tokens=0, ttft_s=None, tokens_per_s=None)
    assert answer_speed(10.0, [10.25]) == AnswerSpeed(num_tokens=1, ttft_s=0.25, tokens_per_s=None)
    # Tokens that arrive together (one read of the socket) give no rate, not infinity.
    assert answer_speed(10.0, [10.5, 10.5, 10.5]).tokens_per_s is None


def test_answer_speed_is_ttft_then_the_tokens_after_the_first_over_their_time():
    speed = answer_speed(10.0, [10.2, 10.3, 10.4, 10.6])
    assert speed.num_tokens == 4
    assert speed.ttft_s == pytest.approx(0.2)
    assert speed.tokens_per_s == pytest.approx(3 / 0.4)


@pytest.mark.parametrize(
    ("speed", "line"),
    [
        (AnswerSpeed(0, None, None), "[0 tokens]"),
        (AnswerSpeed(1, 0.25, None), "[ttft 0.25 s · 1 token]"),
        (AnswerSpeed(57, 0.2149, 38.44), "[ttft 0.21 s · 38.4 tok/s · 57 tokens]"),
    ],
)
def test_describe_speed_leaves_out_what_it_does_not_know(speed, line):
    assert describe_speed(speed) == line


@pytest.mark.parametrize(
    ("url", "socket_url"),
    [
        ("ws://127.0.0.1:8000/ws", "ws://127.0.0.1:8000/ws"),
        ("wss://example.org/chat/ws", "wss://example.org/chat/ws"),
        # The OpenAI API's URL of the same gateway: its socket.
        ("http://127.0.0.1:8000/v1", "ws://127.0.0.1:8000/ws"),
        ("https://example.org:8443/v1/chat/completions?x=1", "wss://example.org:8443/ws"),
    ],
)
def test_websocket_url_keeps_a_socket_and_finds_an_http_gateways(url, socket_url):
    assert websocket_url(url) == socket_url


@pytest.mark.parametrize(
    "url", ["127.0.0.1:8000", "ws://", "ftp://example.org/ws", "http://", "ws://h:99999/ws"]
)
def test_websocket_url_refuses_what_is_no_websocket(url):
    with pytest.raises(BadUrlError, match="ws://HOST:PORT/ws"):
        websocket_url(url)


@pytest.mark.parametrize("url", ["127.0.0.1:8000/ws", "ws://[::1/ws"])
def test_a_bad_url_is_one_line_and_exit_status_2(url):
    chat = subprocess.run(
        [sys.executable, "-m", "orcapod", "chat", "--url", url],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert chat.returncode == 2
    assert chat.stderr.startswith("orcapod chat: ") and chat.stderr.count("\n") == 1, chat.stderr
    assert "ws://HOST:PORT/ws" in chat.stderr and chat.stdout == ""


@pytest.fixture(scope="module")
def tokenizer_and_limits(prepared_model_dir: Path) -> tuple[ChatTokenizer, ModelLimits]:
    tokenizer = ChatTokenizer.from_model_dir(prepared_model_dir)
    return tokenizer, ModelLimits.from_model_dir(prepared_model_dir, tokenizer.vocab_size, 1000)


class Terminal:
    """A process on a pseudo-terminal that is its controlling terminal, so that a typed
    Ctrl-C is a SIGINT from the terminal as a user's is; its output is read as it comes."""

    def __init__(self, master_fd: int, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.output = ""
        self._master_fd = master_fd
        self._read_to = 0  # what expect has matched so far
        self._more = asyncio.Event()
        self._closed = False
        asyncio.get_running_loop().add_reader(master_fd, self._on_readable)

    @classmethod
    @contextlib.asynccontextmanager
    async def run(cls, *argv: str, env: dict[str, str]) -> AsyncIterator[Terminal]:
        master_fd, slave_fd = os.openpty()
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=slave_fd,
                stdout=slave_fd,
                stderr=slave_fd,
                cwd=REPO,
                env=env,
                start_new_session=True,
                # The new session's leader takes the terminal as its controlling one.
                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
            )
        finally:
            os.close(slave_fd)
        terminal = cls(master_fd, process)
        try:
            yield terminal
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            asyncio.get_running_loop().remove_reader(master_fd)
            os.close(master_fd)

    def _on_readable(self) -> None:
        try:
            data = os.read(self._master_fd, 65536)
        except OSError as error:  # EIO: every process of the terminal has closed it
            assert error.errno == errno.EIO, error
            data = b""
        if not data:
            self._closed = True
            asyncio.get_running_loop().remove_reader(self._master_fd)
        self.output += data.decode(errors="replace")
        self._more.set()

    def type(self, keys: str) -> None:
        os.write(self._master_fd, keys.encode())

    async def expect(self, pattern: str) -> re.Match[str]:
        """The first match of ``pattern`` in the output after the previous expect's."""
        regex = re.compile(pattern)

        async def matched() -> re.Match[str]:
            while not (match := regex.search(self.output, self._read_to)):
                assert not self._closed, f"{pattern!r} never came: {self.output!r}"
                self._more.clear()
                await self._more.wait()
            self._read_to = match.end()
            return match

        try:
            return await asyncio.wait_for(matched(), EXPECT_TIMEOUT_S)
        except TimeoutError:
            seen = self.output[: self._read_to] + " <here> " + self.output[self._read_to :]
            raise AssertionError(f"no {pattern!r} after <here> in {seen!r}") from None

    async def exit_status(self) -> int:
        return await asyncio.wait_for(self.process.wait(), EXPECT_TIMEOUT_S)


def test_at_a_terminal_lines_edit_recall_and_clear_and_ctrl_c_stops_only_the_answer(
    redis_server: RedisServer,
    tokenizer_and_limits: tuple[ChatTokenizer, ModelLimits],
    tmp_path: Path,
) -> None:
    tokenizer, limits = tokenizer_and_limits
    question = "What is the capital of France?"
    # No proxies, no user's ~/.inputrc: the defaults a terminal gives.
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TERM": "dumb"}

    async def scenario() -> None:
        async with (
            running_gateway(redis_server, tokenizer, limits) as (server, upstream),
            Terminal.run(
                *(sys.executable, "-m", "orcapod", "chat", "--url", f"{server.http_url}/v1"),
                env=env,
            ) as terminal,
        ):
            # The OpenAI API's URL of the gateway: one line says which socket it took.
            await terminal.expect(re.escape(f"chatting over {server.url}"))
            await terminal.expect(re.escape(f"connected to {server.url}"))
            await terminal.expect("you> ")
            terminal.type(f"{question}\r")
            first = await upstream.next_submit()
            conversation = [{"role": "user", "content": question}]
            assert first.prompt_ids == tokenizer.encode_chat(conversation)
            tokens = worker_tokens(tokenizer, first.request_id, "Paris.", finish="stop")
            await upstream.publish(*tokens)
            speed = await terminal.expect(SPEED_LINE.pattern)
            assert int(speed["num_tokens"]) == len(tokens) and float(speed["ttft_s"]) < 5

            # Ctrl-C at the prompt drops the line typed so far (readline has echoed it)...
            await terminal.expect("you> ")
            terminal.type("Tell me a joke")
            await terminal.expect("Tell me a joke")
            # At a typist's pace: CPython's readline checks for signals only when one
            # interrupts its select(), so a Ctrl-C that lands while it is still echoing
            # the previous key waits for the next key (0.2 s was too short once, on a
            # machine whose two cores a benchmark held).
            await asyncio.sleep(1.0)
            # Under load the Ctrl-C can still land mid-echo and wait for a next key: a
            # second Ctrl-C is that key (at a cleared line it only redraws the prompt).
            for attempt in range(3):
                terminal.type("\x03")
                try:
                    await terminal.expect("you> ")
                    break
                except AssertionError:
                    if attempt == 2:
                        raise
            # ... and keeps the conversation; Up recalls the question.
            terminal.type("\x1b[A")
            await terminal.expect(re.escape(question))
            terminal.type("\r")
            second = await upstream.next_submit()
            conversation += [
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": question},
            ]
            assert second.prompt_ids == tokenizer.encode_chat(conversation)

            # Ctrl-C while the answer streams cancels it and comes back to the prompt.
            streamed = worker_tokens(tokenizer, second.request_id, "Paris", None)
            await upstream.publish(*streamed)
            await terminal.expect("Paris")
            terminal.type("\x03")
            assert (await upstream.next_cancel()).request_id == second.request_id
            await terminal.expect(r"\[cancelled\]")
            speed = await terminal.expect(SPEED_LINE.pattern)
            assert int(speed["num_tokens"]) == len(streamed)
            await terminal.expect("you> ")

            # Ctrl-D at the prompt leaves.
            terminal.type("\x04")
            assert await terminal.exit_status() == 0
            assert "Traceback" not in terminal.output

    asyncio.run(asyncio.wait_for(scenario(), 30))
