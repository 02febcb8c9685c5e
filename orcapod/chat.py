"""``orcapod chat``: a terminal chat client for a running orcapod.

Owns the prompt loop, the URL it connects to and the speed line after each
answer. Lines are read by ``input()`` on the main thread, the one where Python
raises KeyboardInterrupt, so readline edits them, keeps their history (in
memory, for the session) and drops the line being typed on Ctrl-C; read on
another thread, the line would survive the Ctrl-C. The websocket is the
``websockets`` sync client, whose own thread answers the gateway's keepalive
pings while the prompt waits.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection, connect
from websockets.uri import parse_uri

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

USAGE = "Ctrl-C stops an answer or clears the line; /reset starts over; Ctrl-D or /quit leaves."
# How soon a Ctrl-C during an answer sends its cancel: the signal only sets a
# flag (interrupting the socket's receive could drop a frame), read this often.
INTERRUPT_CHECK_S = 0.05


def build_parser() -> argparse.ArgumentParser:
    """``orcapod chat``'s command line (``docs/configuration.md`` is made from it)."""
    parser = argparse.ArgumentParser(
        prog="orcapod chat", description=f"Chat with a running orcapod. {USAGE}"
    )
    parser.add_argument(
        "--url",
        default="ws://127.0.0.1:8000/ws",
        help="the gateway's websocket (an http:// URL of the gateway means its /ws)",
    )
    parser.add_argument("--api-key", help="sent as a Bearer token (default: $ORCAPOD_API_KEY)")
    parser.add_argument("--system", default=None, help="a system message to start with")
    parser.add_argument("--max-tokens", type=int, default=512, help="the most tokens of one answer")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling")
    parser.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: the gateway picks one)"
    )
    return parser


class BadUrlError(ValueError):
    """``--url`` names no websocket the client can open."""


def websocket_url(url: str) -> str:
    """The websocket to chat over for ``url``.

    A ``ws://`` or ``wss://`` URL is itself; an ``http://`` or ``https://`` one
    (the OpenAI API's, say) is the same gateway's socket: same host and port,
    path ``/ws``. Raises :class:`BadUrlError` for anything else.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        socket_url = url
        if parts.scheme in ("http", "https") and parts.netloc:
            scheme = "wss" if parts.scheme == "https" else "ws"
            socket_url = urllib.parse.urlunsplit((scheme, parts.netloc, "/ws", "", ""))
        parse_uri(socket_url)
    except (InvalidURI, ValueError) as error:  # ValueError: a port out of range, say
        reason = error.msg if isinstance(error, InvalidURI) else str(error)
        raise BadUrlError(
            f"{url!r} is not a websocket URL ({reason}); give ws://HOST:PORT/ws"
        ) from error
    return socket_url


@dataclass(frozen=True)
class AnswerSpeed:
    """How fast one answer came, as this client saw it."""

    num_tokens: int
    ttft_s: float | None  # None: no token came
    tokens_per_s: float | None  # None: under two tokens, or all arrived at once


def answer_speed(sent_at_s: float, token_times_s: Sequence[float]) -> AnswerSpeed:
    """TTFT from sending to the first token; the decode rate as the tokens after
    the first over the time from the first to the last."""
    if not token_times_s:
        return AnswerSpeed(num_tokens=0, ttft_s=None, tokens_per_s=None)
    num_decoded = len(token_times_s) - 1
    decode_s = token_times_s[-1] - token_times_s[0]
    return AnswerSpeed(
        num_tokens=len(token_times_s),
        ttft_s=token_times_s[0] - sent_at_s,
        tokens_per_s=num_decoded / decode_s if num_decoded > 0 and decode_s > 0 else None,
    )


def describe_speed(speed: AnswerSpeed) -> str:
    """One line, as ``[ttft 0.21 s · 38.4 tok/s · 57 tokens]``; unknown parts left out."""
    parts = []
    if speed.ttft_s is not None:
        parts.append(f"ttft {speed.ttft_s:.2f} s")
    if speed.tokens_per_s is not None:
        parts.append(f"{speed.tokens_per_s:.1f} tok/s")
    parts.append(f"{speed.num_tokens} token{'' if speed.num_tokens == 1 else 's'}")
    return f"[{' · '.join(parts)}]"


@dataclass(frozen=True)
class _Answer:
    text: str
    finish_reason: str  # a Done's, or "error"
    speed: AnswerSpeed


def _stream_answer(socket: ClientConnection, request: Generate) -> _Answer:
    """Send ``request`` and print its answer as it streams. Ctrl-C meanwhile
    cancels it; the gateway then ends it with ``done`` (cancelled)."""
    interrupted = threading.Event()
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        parts: list[str] = []
        token_times_s: list[float] = []
        sent_at_s = time.monotonic()
        socket.send(encode_json(request))
        cancel_sent = False
        while True:
            if interrupted.is_set() and not cancel_sent:
                socket.send(encode_json(Cancel(id=request.id)))
                cancel_sent = True
            try:
                frame = socket.recv(timeout=INTERRUPT_CHECK_S)
            except TimeoutError:
                continue
            message = decode_server_message(frame)
            if isinstance(message, Token) and message.id == request.id:
                token_times_s.append(time.monotonic())
                parts.append(message.text)
                print(message.text, end="", flush=True)
            elif isinstance(message, Done) and message.id == request.id:
                speed = answer_speed(sent_at_s, token_times_s)
                return _Answer("".join(parts), message.finish_reason, speed)
            elif isinstance(message, Error):
                print(f"\n[error {message.code}: {message.message}]", file=sys.stderr)
                return _Answer("".join(parts), "error", answer_speed(sent_at_s, token_times_s))
    finally:
        signal.signal(signal.SIGINT, previous_handler)


def _dim(text: str) -> str:
    return f"\x1b[2m{text}\x1b[0m" if sys.stdout.isatty() else text


def _converse(socket: ClientConnection, args: argparse.Namespace) -> None:
    """Prompt, send, stream, until /quit or the end of input (Ctrl-D)."""
    opening = [ChatMessage(role="system", content=args.system)] if args.system else []
    history = list(opening)
    while True:
        try:
            line = input("you> ")
            if line.strip() == "/quit":
                return
            if line.strip() == "/reset":
                history = list(opening)
                print("(conversation cleared)\n")
                continue
            if not line.strip():
                continue
            question = ChatMessage(role="user", content=line)
            request = Generate(
                id=uuid.uuid4().hex[:12],
                messages=[*history, question],
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
            )
            print("assistant> ", end="", flush=True)
            answer = _stream_answer(socket, request)
            print(f"   [{answer.finish_reason}]" if answer.finish_reason != "stop" else "")
            if answer.finish_reason != "error":
                print(_dim(describe_speed(answer.speed)))
                # One assignment: the turn joins the conversation whole or not at all.
                history = [*history, question, ChatMessage(role="assistant", content=answer.text)]
            print()
        except KeyboardInterrupt:
            # At the prompt (or between answers) Ctrl-C drops the line, not the conversation.
            print()
        except EOFError:
            print()
            return


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``orcapod chat``."""
    args = build_parser().parse_args(argv)
    try:
        url = websocket_url(args.url)
    except BadUrlError as error:
        print(f"orcapod chat: {error}", file=sys.stderr)
        return 2
    if url != args.url:
        print(
            f"orcapod chat: {args.url} is HTTP, this client speaks websockets: chatting over {url}",
            file=sys.stderr,
        )
    # Loaded for its side effect: input() then edits lines and keeps their history.
    with contextlib.suppress(ImportError):
        importlib.import_module("readline")
    headers = auth_headers(client_api_key(args.api_key))
    try:
        with connect(url, max_size=None, additional_headers=headers) as socket:
            print(f"connected to {url}. {USAGE}\n")
            _converse(socket, args)
        return 0
    except KeyboardInterrupt:  # while connecting
        print()
        return 0
    except InvalidStatus as error:
        status = error.response.status_code
        hint = " (give an API key: --api-key or ORCAPOD_API_KEY)" if status == 401 else ""
        print(f"orcapod chat: {url} refused the connection: HTTP {status}{hint}", file=sys.stderr)
        return 1
    except ConnectionClosed as error:
        print(f"\norcapod chat: the connection to {url} closed: {error}", file=sys.stderr)
        return 1
    except (OSError, InvalidHandshake, InvalidURI, msgspec.DecodeError) as error:
        print(f"orcapod chat: cannot talk to {url}: {error}", file=sys.stderr)
        return 1
