"""Connections that never finish a request, against the real service: 100 that
send nothing, 100 that send a header line every half second, 100 that drip a
chunked body to /v1/chat/completions 3 bytes at a time. Each is closed at its
timeout, and the gateway's file descriptors go back to where they were.

The timeouts are the ones ``tests/adversarial/service.py`` starts the gateway
with (idle 2 s, headers 3 s, body 3 s)."""

from __future__ import annotations

import asyncio
import os

from tests.adversarial.service import KEYS, Service

IDLE_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 3.0
NUM_EACH = 100
DRIP_EVERY_S = 0.5
# 300 connections at once on a 2-core machine the model shares: late, never early
# but for the two clocks' offset.
LATE_S = 3.0
EARLY_S = 0.1
# The gateway's own descriptors may come and go meanwhile (a Redis connection).
FD_SLACK = 5


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def seconds_until_closed(service: Service, head: bytes, drips: list[bytes]) -> float:
    """Open a connection, send ``head``, then one of ``drips`` every half second:
    the seconds from ``head`` until the gateway closed it (it must answer nothing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    loop = asyncio.get_running_loop()
    writer.write(head)
    start_s = loop.time()
    pending = iter(drips)
    try:
        while loop.time() - start_s < 30:
            try:
                data = await asyncio.wait_for(reader.read(4096), DRIP_EVERY_S)
            except TimeoutError:
                writer.write(next(pending, b""))
                await writer.drain()
                continue
            assert not data, f"the gateway answered {data[:200]!r}"
            return loop.time() - start_s
        raise AssertionError("still open after 30 s")
    except ConnectionError:
        return loop.time() - start_s
    finally:
        writer.close()


def test_connections_that_never_finish_a_request_are_closed_and_their_fds_freed(
    service: Service,
) -> None:
    pid = service.pids["-m gateway"]
    post = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {KEYS['attacker']}\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    body = b"".join(b"1\r\n%c\r\n" % byte for byte in b'{"messages": [' * 20)
    header_lines = [f"X-Slow-{i}: {i}\r\n".encode() for i in range(100)]

    async def scenario() -> tuple[int, int, int, list[float], list[float], list[float]]:
        before = num_fds(pid)
        async with asyncio.TaskGroup() as tasks:
            silent = [
                tasks.create_task(seconds_until_closed(service, b"", [])) for _ in range(NUM_EACH)
            ]
            slow_headers = [
                tasks.create_task(
                    seconds_until_closed(service, b"GET /healthz HTTP/1.1\r\n", header_lines)
                )
                for _ in range(NUM_EACH)
            ]
            slow_bodies = [
                tasks.create_task(
                    seconds_until_closed(
                        service, post, [body[i : i + 3] for i in range(0, len(body), 3)]
                    )
                )
                for _ in range(NUM_EACH)
            ]
            peak = before
            while not all(task.done() for task in silent):
                peak = max(peak, num_fds(pid))
                await asyncio.sleep(0.1)
        after = num_fds(pid)
        for _ in range(50):
            if after <= before + FD_SLACK:
                break
            await asyncio.sleep(0.1)
            after = num_fds(pid)
        return (
            before,
            peak,
            after,
            [task.result() for task in silent],
            [task.result() for task in slow_headers],
            [task.result() for task in slow_bodies],
        )

    before, peak, after, silent_s, headers_s, bodies_s = asyncio.run(scenario())
    print(
        f"gateway fds: {before} before, {peak} with {3 * NUM_EACH} connections open, "
        f"{after} after; closed after {max(silent_s):.1f} s (idle), "
        f"{max(headers_s):.1f} s (headers), {max(bodies_s):.1f} s (body)"
    )
    assert peak >= before + 3 * NUM_EACH - FD_SLACK, "the connections were never all open"
    assert after <= before + FD_SLACK
    # The silent ones were counted from their connect, the others from their first bytes;
    # the gateway's clock starts a moment before the client's (a closing seen at
    # 2.9998 s of a 3 s timeout), hence EARLY_S.
    for timeout_s, closed_s in (
        (IDLE_TIMEOUT_S, silent_s),
        (HEADER_TIMEOUT_S, headers_s),
        (BODY_TIMEOUT_S, bodies_s),
    ):
        assert timeout_s - EARLY_S <= min(closed_s) <= max(closed_s) < timeout_s + LATE_S
