"""Attacks on memory: replays into a socket that does not read, frames that
inflate, oversized frames; and what requests leave in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.adversarial.service import (
    KEYS,
    PREFIX,
    Client,
    Service,
    open_socket,
    rss_bytes,
    wait_closed,
)

TRY_AGAIN_LATER = 1013
MESSAGE_TOO_BIG = 1009
RSS_GROWTH_LIMIT = 96 << 20


def _gateway_rss(service: Service) -> int:
    return rss_bytes(service.pids["-m gateway"])


def test_replays_into_a_socket_that_does_not_read_close_it(service: Service) -> None:
    """Thousands of `resume`s of a finished request, never reading: the socket is
    closed with 1013 once its outbox is over its byte cap; the gateway stays small."""

    async def attack() -> int | None:
        async with open_socket(service, "attacker", max_queue=1) as socket:
            outcome = await Client(socket).ask("long", max_tokens=64, ignore_eos=True)
            resume = json.dumps({"type": "resume", "request_id": outcome.request_id})
            # Stop reading: only the kernel's buffers and the gateway's outbox fill.
            socket.transport.pause_reading()
            for _ in range(4000):
                await socket.send(resume)
            socket.transport.resume_reading()
            return await wait_closed(socket, 60)

    before = _gateway_rss(service)
    assert asyncio.run(attack()) == TRY_AGAIN_LATER
    growth = _gateway_rss(service) - before
    print(f"replay flood: closed 1013, gateway RSS {growth / 2**20:+.1f} MiB")
    assert growth < RSS_GROWTH_LIMIT


def test_a_compressed_frame_cannot_inflate_past_the_frame_limit(service: Service) -> None:
    async def attack() -> int | None:
        headers = {"Authorization": f"Bearer {KEYS['attacker']}"}
        async with connect(service.url, additional_headers=headers, compression="deflate") as ws:
            # 64 MiB of one letter deflates to ~64 KiB on the wire.
            await ws.send(json.dumps({"type": "generate", "id": "z", "prompt": "a" * (64 << 20)}))
            return await wait_closed(ws, 30)

    before = _gateway_rss(service)
    assert asyncio.run(attack()) == MESSAGE_TOO_BIG
    growth = _gateway_rss(service) - before
    print(f"64 MiB deflated frame: closed 1009, gateway RSS {growth / 2**20:+.1f} MiB")
    assert growth < RSS_GROWTH_LIMIT


def test_a_frame_over_the_limit_closes_only_its_socket(service: Service) -> None:
    async def attack() -> tuple[int | None, str]:
        async with open_socket(service, "attacker", compression=None) as socket:
            # The gateway may close (1009) while the frame is still being sent.
            with contextlib.suppress(ConnectionClosed):
                await socket.send("x" * (2 << 20))
            code = await wait_closed(socket, 30)
        async with open_socket(service, "attacker") as socket:
            outcome = await Client(socket).ask("next", max_tokens=2)
        assert outcome.end is not None
        return code, str(outcome.end["type"])

    code, next_end = asyncio.run(attack())
    assert code == MESSAGE_TOO_BIG and next_end == "done"


# Keys that live as long as the service does.
PERMANENT = (
    "requests",
    "control",
    "results",
    "dead",
    "epoch",
    "tenants",
    "stats",
    "step_timing",
    "prefix_cache",  # five counters, whatever the load
    "ready",
)


def test_every_request_key_in_redis_expires(service: Service) -> None:
    """After the attacks above, every per-request and per-tenant key has a TTL,
    and no finished request's log outlives the resume window by much."""
    with service.redis() as client:
        names = [name.decode() for name in client.scan_iter(match=f"{PREFIX}:*", count=1000)]
        assert names
        for name in names:
            suffix = name.removeprefix(f"{PREFIX}:")
            if suffix in PERMANENT or suffix.startswith(("plans:", "worker:", "gateway:")):
                continue
            ttl_s = client.ttl(name)
            assert ttl_s > 0, (name, ttl_s)
