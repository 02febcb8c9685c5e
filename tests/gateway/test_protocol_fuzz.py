"""Property-based fuzzing of the websocket protocol against a real gateway (issue 6, "Bad input").

A real GatewayServer on a real redis-server, real websockets clients on
loopback and the real tokenizer; hypothesis draws the bad input
(tests/gateway/bad_frames.py). Every example checks that:

- each bad frame gets exactly one `error` frame, in order, with the expected
  code of the protocol, and nothing it sent reaches the scheduler;
- the socket stays open and usable (a valid `generate` afterwards is
  accepted), unless the client broke the websocket protocol itself (invalid
  UTF-8 in a text frame, a frame over the library's limit): then that socket
  alone closes, and its live request is cancelled upstream;
- another client's request, fed tokens (out of order, duplicated) while the
  bad input arrives, gets each token once, in order, then its `done`;
- the gateway still runs: its task is alive, /healthz answers 200 and a new
  socket completes its handshake.

One gateway per test serves all its examples (tests/gateway/live_gateway.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.keys import MESSAGE_FIELD
from shared.messages import (
    CancelRequest,
    SampledToken,
    SamplingParams,
    SubmitRequest,
    TokenBatch,
    decode_control_message,
    encode,
)
from shared.protocol import Done, Error
from tests.conftest import RedisServer
from tests.gateway.bad_frames import (
    BAD_FRAMES,
    CONTEXT_TOKENS,
    JSON_VALUES,
    LIVE_ID,
    LIVE_IDS,
    MAX_TOKENS_LIMIT,
    SENDABLE_TEXT,
    VOCAB_SIZE,
    BadFrame,
    oversized,
)
from tests.gateway.live_gateway import LiveGateway
from tests.gateway.test_server import (
    GATEWAY_ID,
    KEYS,
    TIMEOUT_S,
    receive,
    receive_until_done,
    send,
)
from tests.gateway.worker_tokens import worker_tokens

BYSTANDER_ID = "bystander"
BYSTANDER_TEXT = "The other stream 🦩 goes on, untouched."
FUZZ_SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# A map nested deeper than msgspec recurses: it raises RecursionError, not DecodeError.
NESTED_MAP = b"\x81\xa1a" * 5_000 + b"\xc0"


@pytest.fixture
def gateway(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> Iterator[LiveGateway]:
    """One gateway for all of a test's examples."""
    limits = (model_limits.context_tokens, model_limits.vocab_size, model_limits.max_tokens_limit)
    assert limits == (CONTEXT_TOKENS, VOCAB_SIZE, MAX_TOKENS_LIMIT), "update bad_frames.py"
    with asyncio.Runner() as runner:
        live = LiveGateway(runner, redis_server.url, chat_tokenizer, model_limits)
        runner.run(live.start())
        try:
            yield live
        finally:
            runner.run(live.stop())


async def feed_bystander(gateway: LiveGateway, request_id: str) -> int:
    """Publish the bystander's tokens out of order and twice over, yielding between batches
    so the fuzzed frames interleave; returns how many tokens it has."""
    tokens = worker_tokens(gateway.tokenizer, request_id, BYSTANDER_TEXT)
    for batch in (tokens[1:3], tokens[:2], tokens[2:6], tokens[5:], tokens):
        await gateway.upstream.publish(*batch)
        await asyncio.sleep(0)
    return len(tokens)


async def assert_bystander_untouched(socket: ClientConnection, num_tokens: int) -> None:
    frames, done = await receive_until_done(socket)
    assert [frame.seq for frame in frames] == list(range(num_tokens))
    assert "".join(frame.text for frame in frames) == BYSTANDER_TEXT
    assert (done.id, done.finish_reason) == (BYSTANDER_ID, "length")


def replied(frame: Any) -> tuple[str, str, str | None]:
    """A server frame as (type, code or finish reason, id), to compare with a model."""
    if isinstance(frame, Error):
        return ("error", frame.code, frame.id)
    if isinstance(frame, Done):
        return ("done", frame.finish_reason, frame.id)
    return (type(frame).__name__, "", getattr(frame, "id", None))


# --- bad frames on an open socket ----------------------------------------------------------


@settings(FUZZ_SETTINGS, max_examples=150)
@given(frames=st.lists(BAD_FRAMES, min_size=1, max_size=12))
@example(  # found here: msgspec's RecursionError on deep nesting became an `internal` error
    frames=[BadFrame("deeply nested", '{"type":"generate","x":' + "[" * 2000 + "]" * 2000 + "}")]
)
@example(  # found here: accepted, then the SubmitRequest could not be encoded for Redis
    frames=[BadFrame("top_k", f'{{"type":"generate","id":"x","prompt":"Hi","top_k":{2**64}}}')]
)
def test_every_bad_frame_gets_one_error_and_the_socket_stays_usable(
    gateway: LiveGateway, frames: list[BadFrame]
) -> None:
    async def scenario() -> None:
        async with connect(gateway.server.url) as fuzzed, connect(gateway.server.url) as other:
            bystander_request = await gateway.accept(other, BYSTANDER_ID)
            live = {client_id: await gateway.accept(fuzzed, client_id) for client_id in LIVE_IDS}

            async def send_frames() -> None:
                for frame in frames:
                    await fuzzed.send(frame.sent_with(live))

            _, num_tokens = await asyncio.gather(
                send_frames(), feed_bystander(gateway, bystander_request)
            )
            replies, after = await gateway.replies_then_accept(fuzzed, "after")
            assert [replied(reply)[:2] for reply in replies] == [
                ("error", frame.code) for frame in frames
            ]
            await gateway.assert_only_accepted_requests_submitted(after)
            await assert_bystander_untouched(other, num_tokens)
            # The live requests are still where they were, under their ids.
            for client_id in LIVE_IDS:
                await send(fuzzed, type="cancel", id=client_id)
                assert replied(await receive(fuzzed)) == ("done", "cancelled", client_id)
        await gateway.assert_alive()

    gateway.run(scenario)
    gateway.run(gateway.assert_no_socket_left)


# --- floods of cancels and resumes ---------------------------------------------------------

KNOWN_IDS = ("k0", "k1", "k2", "k3")
UNKNOWN_ID = SENDABLE_TEXT.filter(lambda text: bool(text) and text not in KNOWN_IDS)
FLOOD_ITEM = st.one_of(
    st.sampled_from(KNOWN_IDS).map(lambda client_id: {"type": "cancel", "id": client_id}),
    UNKNOWN_ID.map(lambda client_id: {"type": "cancel", "id": client_id}),
    st.fixed_dictionaries(
        {"type": st.just("resume"), "request_id": st.uuids().map(lambda uuid: uuid.hex)},
        optional={
            "after_seq": st.integers(-1, 2**64 - 1),
            "id": UNKNOWN_ID | st.sampled_from(KNOWN_IDS),
        },
    ),
)


@settings(FUZZ_SETTINGS, max_examples=20)
@given(flood=st.lists(FLOOD_ITEM, min_size=100, max_size=400))
def test_a_flood_of_cancels_and_resumes_is_answered_frame_by_frame(
    gateway: LiveGateway, flood: list[dict[str, Any]]
) -> None:
    """Hundreds of cancels of known ids (again and again) and unknown ids, and resumes of
    request_ids nobody knows: the first cancel of a live request ends it with `done`
    and one CancelRequest upstream; every other frame gets an `error` naming its id."""
    expected: list[tuple[str, str, str | None]] = []
    live = set(KNOWN_IDS)
    for message in flood:
        if message["type"] == "cancel" and message["id"] in live:
            live.discard(message["id"])
            expected.append(("done", "cancelled", message["id"]))
        else:
            expected.append(("error", "invalid_request", message.get("id")))

    async def scenario() -> None:
        async with connect(gateway.server.url) as fuzzed, connect(gateway.server.url) as other:
            bystander_request = await gateway.accept(other, BYSTANDER_ID)
            known = {client_id: await gateway.accept(fuzzed, client_id) for client_id in KNOWN_IDS}

            async def send_flood() -> None:
                for message in flood:
                    await send(fuzzed, **message)

            _, num_tokens = await asyncio.gather(
                send_flood(), feed_bystander(gateway, bystander_request)
            )
            replies, after = await gateway.replies_then_accept(fuzzed, "after")
            assert [replied(reply) for reply in replies] == expected
            await gateway.assert_only_accepted_requests_submitted(after)
            await assert_bystander_untouched(other, num_tokens)
            cancelled = {known[client_id] for client_id in set(KNOWN_IDS) - live}
            cancels = await cancels_upstream(gateway, set(known.values()))
            assert sorted(cancels) == sorted(cancelled)  # each once, the others not yet
        await gateway.assert_alive()

    gateway.run(scenario)
    gateway.run(gateway.assert_no_socket_left)


async def cancels_upstream(gateway: LiveGateway, request_ids: set[str]) -> list[str]:
    """The CancelRequests on the control stream for any of ``request_ids``."""
    entries: Any = await gateway.upstream.redis.xrange(KEYS.control)
    messages = [decode_control_message(fields[MESSAGE_FIELD.encode()]) for _, fields in entries]
    return [
        message.request_id
        for message in messages
        if isinstance(message, CancelRequest) and message.request_id in request_ids
    ]


# --- frames that break the websocket protocol ----------------------------------------------

INVALID_UTF8 = (b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xe2\x82", b"\x80")
INVALID_DATA = 1007
MESSAGE_TOO_BIG = 1009


@dataclass(frozen=True)
class BrokenFrame:
    """A frame the websocket library itself refuses by closing the connection."""

    data: bytes
    text: bool
    close_code: int

    def __repr__(self) -> str:
        return f"BrokenFrame({self.data[:120]!r}, {len(self.data)} bytes, text={self.text})"


def _invalid_utf8_text(parts: tuple[str, bytes, str]) -> BrokenFrame:
    """A generate whose prompt holds bytes that are not UTF-8 (a lone surrogate among them),
    in a text frame: the only way to send one, as websockets will not encode a lone
    surrogate of a str."""
    prompt = parts[0].encode() + parts[1] + parts[2].encode()
    data = b'{"type":"generate","id":"s","prompt":"' + prompt + b'"}'
    return BrokenFrame(data, text=True, close_code=INVALID_DATA)


BROKEN_FRAMES = st.one_of(
    st.tuples(SENDABLE_TEXT, st.sampled_from(INVALID_UTF8), SENDABLE_TEXT).map(_invalid_utf8_text),
    oversized().map(lambda frame: BrokenFrame(frame[0], frame[1], MESSAGE_TOO_BIG)),
)


@settings(FUZZ_SETTINGS, max_examples=25)
@given(frame=BROKEN_FRAMES)
def test_a_frame_that_breaks_the_websocket_protocol_closes_only_its_socket(
    gateway: LiveGateway, frame: BrokenFrame
) -> None:
    async def scenario() -> None:
        async with connect(gateway.server.url) as broken, connect(gateway.server.url) as other:
            bystander_request = await gateway.accept(other, BYSTANDER_ID)
            victim = await gateway.accept(broken, LIVE_ID)
            # The gateway may close before a big frame is all sent.
            with contextlib.suppress(ConnectionClosed):
                await broken.send(frame.data, text=frame.text)
            num_tokens = await feed_bystander(gateway, bystander_request)
            await asyncio.wait_for(broken.wait_closed(), TIMEOUT_S)
            assert broken.close_code == frame.close_code
            await assert_bystander_untouched(other, num_tokens)
            for _ in range(100):
                if await cancels_upstream(gateway, {victim}):
                    break
                await asyncio.sleep(0.02)
            assert await cancels_upstream(gateway, {victim}) == [victim]
        await gateway.assert_alive()

    gateway.run(scenario)
    gateway.run(gateway.assert_no_socket_left)


# --- garbage on the gateway's tokens channel -----------------------------------------------


def _msgpack(value: Any) -> bytes | None:
    try:
        return msgspec.msgpack.encode(value)
    except (OverflowError, UnicodeEncodeError, msgspec.EncodeError):
        return None


def _out_of_vocabulary(token_id: int) -> bytes:
    return encode(TokenBatch(worker_id="w0", tokens=[SampledToken("r", token_id, 0, None)]))


WRONG_STREAM = encode(SubmitRequest("r", GATEWAY_ID, "t", [1], SamplingParams()))
GARBAGE = st.one_of(
    st.binary(max_size=64),
    JSON_VALUES.map(_msgpack).filter(lambda data: data is not None),
    st.integers(min_value=VOCAB_SIZE, max_value=2**63 - 1).map(_out_of_vocabulary),
    st.integers(min_value=-(2**63), max_value=-1).map(_out_of_vocabulary),
    st.sampled_from([NESTED_MAP, WRONG_STREAM, b""]),
)


@settings(FUZZ_SETTINGS, max_examples=40)
@given(garbage=st.lists(GARBAGE, min_size=1, max_size=8))
@example(garbage=[NESTED_MAP])
def test_garbage_on_the_tokens_channel_is_dead_lettered_with_a_log_line(
    gateway: LiveGateway, garbage: list[bytes]
) -> None:
    channel = KEYS.tokens(GATEWAY_ID)

    async def scenario() -> None:
        async with connect(gateway.server.url) as other:
            bystander_request = await gateway.accept(other, BYSTANDER_ID)
            dead_before = await dead_entries(gateway)
            with capture_logs() as logs:
                for data in garbage:
                    await gateway.upstream.publish_raw(data)
                num_tokens = await feed_bystander(gateway, bystander_request)
                await assert_bystander_untouched(other, num_tokens)
                for _ in range(100):
                    if len(await dead_entries(gateway)) >= len(dead_before) + len(garbage):
                        break
                    await asyncio.sleep(0.02)
            dead = (await dead_entries(gateway))[len(dead_before) :]
            assert [fields[b"data"] for fields in dead] == garbage
            assert all(
                fields[b"source"] == channel.encode() and fields[b"error"] for fields in dead
            )
            lines = [
                log
                for log in logs
                if log["log_level"] in ("warning", "error")
                and channel in (log.get("source"), log.get("channel"))
            ]
            assert len(lines) == len(garbage), logs
        await gateway.assert_alive()

    gateway.run(scenario)
    gateway.run(gateway.assert_no_socket_left)


async def dead_entries(gateway: LiveGateway) -> list[dict[bytes, bytes]]:
    entries: Any = await gateway.upstream.redis.xrange(KEYS.dead)
    return [fields for _, fields in entries]
