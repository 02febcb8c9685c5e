"""``orcapod chat``: a terminal chat client for a running orcapod.

Keeps the conversation, streams each answer as it is generated; Ctrl-C
stops the current answer (the request is cancelled) and returns to the
prompt; Ctrl-C at the prompt, Ctrl-D or /quit leaves. /reset starts over.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
import uuid

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from shared.protocol import (
    Cancel,
    ChatMessage,
    Done,
    Error,
    Generate,
    Token,
    decode_server_message,
    encode_json,
)
from shared.settings import auth_headers, client_api_key


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orcapod chat", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/ws")
    parser.add_argument("--api-key", help="sent as a Bearer token (default: $ORCAPOD_API_KEY)")
    parser.add_argument("--system", default=None, help="a system message to start with")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=None)
    return parser


async def _answer(
    socket: ClientConnection, request: Generate, interrupted: asyncio.Event
) -> tuple[str, str]:
    """Stream one answer; returns (text, finish_reason)."""
    await socket.send(encode_json(request))
    parts: list[str] = []
    cancel_sent = False
    while True:
        receive = asyncio.ensure_future(socket.recv())
        interrupt = asyncio.ensure_future(interrupted.wait())
        done, _ = await asyncio.wait({receive, interrupt}, return_when=asyncio.FIRST_COMPLETED)
        if receive not in done:
            receive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receive
        interrupt.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await interrupt
        if interrupted.is_set() and not cancel_sent:
            cancel_sent = True
            await socket.send(encode_json(Cancel(id=request.id)))
        if receive not in done:
            continue
        message = decode_server_message(receive.result())
        if isinstance(message, Token) and message.id == request.id:
            parts.append(message.text)
            print(message.text, end="", flush=True)
        elif isinstance(message, Done) and message.id == request.id:
            return "".join(parts), message.finish_reason
        elif isinstance(message, Error):
            print(f"\n[error {message.code}: {message.message}]", file=sys.stderr)
            return "".join(parts), "error"


class _LineReader:
    """Reads stdin lines on a daemon thread, one per ``read`` call.

    A daemon thread, unlike the loop's executor, never keeps the process
    alive waiting for Enter after the user asked to leave.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._wanted = threading.Semaphore(0)
        self._lines: asyncio.Queue[str | None] = asyncio.Queue()
        threading.Thread(target=self._run, name="stdin", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._wanted.acquire()
            try:
                line: str | None = input("\nyou> ")
            except EOFError:
                line = None
            self._loop.call_soon_threadsafe(self._lines.put_nowait, line)

    async def read(self) -> str | None:
        """The next line, or None at end of input."""
        self._wanted.release()
        return await self._lines.get()


async def _chat(args: argparse.Namespace) -> int:
    history: list[ChatMessage] = []
    if args.system:
        history.append(ChatMessage(role="system", content=args.system))
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    quitting = asyncio.Event()
    answering = False

    def on_sigint() -> None:
        (interrupted if answering else quitting).set()

    reader = _LineReader(loop)
    headers = auth_headers(client_api_key(args.api_key))
    async with connect(args.url, max_size=None, additional_headers=headers) as socket:
        print(f"connected to {args.url}. Ctrl-C stops an answer; /reset, /quit or Ctrl-D.")
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            while True:
                read = asyncio.ensure_future(reader.read())
                quit_wait = asyncio.ensure_future(quitting.wait())
                await asyncio.wait({read, quit_wait}, return_when=asyncio.FIRST_COMPLETED)
                quit_wait.cancel()
                if quitting.is_set() or read.result() is None:
                    read.cancel()
                    print()
                    return 0
                line = read.result() or ""
                if line.strip() == "/quit":
                    return 0
                if line.strip() == "/reset":
                    history = history[:1] if args.system else []
                    print("(conversation cleared)")
                    continue
                if not line.strip():
                    continue
                history.append(ChatMessage(role="user", content=line))
                request = Generate(
                    id=uuid.uuid4().hex[:12],
                    messages=list(history),
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    seed=args.seed,
                )
                print("assistant> ", end="", flush=True)
                interrupted.clear()
                answering = True
                try:
                    text, finish_reason = await _answer(socket, request, interrupted)
                finally:
                    answering = False
                print(f"   [{finish_reason}]" if finish_reason != "stop" else "")
                if finish_reason == "error":
                    history.pop()
                else:
                    history.append(ChatMessage(role="assistant", content=text))
        finally:
            loop.remove_signal_handler(signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``orcapod chat``."""
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_chat(args))
    except KeyboardInterrupt:
        print()
        return 0
    except InvalidStatus as error:
        status = error.response.status_code
        hint = " (give an API key: --api-key or ORCAPOD_API_KEY)" if status == 401 else ""
        print(
            f"orcapod chat: {args.url} refused the connection: HTTP {status}{hint}", file=sys.stderr
        )
        return 1
    except (OSError, msgspec.DecodeError) as error:
        print(f"orcapod chat: cannot talk to {args.url}: {error}", file=sys.stderr)
        return 1
