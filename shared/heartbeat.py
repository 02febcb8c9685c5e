"""What every actor's shell knows of liveness keys and waiting: the heartbeat
key's lifetime, a sleep that a stop event cuts short, a wait for the first of
several events.

One helper so the gateway and the worker (and whoever reads their keys) agree
on how long a heartbeat key outlives its last refresh.
"""

from __future__ import annotations

import asyncio
import contextlib

# A heartbeat key outlives this many missed refreshes before its actor counts as gone.
HEARTBEAT_TTL_FACTOR = 3
# Never shorter: a fast beat on a loaded machine must not flap.
MIN_HEARTBEAT_TTL_MS = 1_000


def heartbeat_ttl_ms(heartbeat_s: float) -> int:
    """The lifetime (PX) a heartbeat key gets at each refresh every ``heartbeat_s``."""
    return max(MIN_HEARTBEAT_TTL_MS, int(HEARTBEAT_TTL_FACTOR * heartbeat_s * 1000))


async def wait_any(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with asyncio.TaskGroup() as tasks:
        waits = [tasks.create_task(event.wait()) for event in events]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()


async def sleep_unless_set(stop: asyncio.Event, delay_s: float) -> None:
    """Wait ``delay_s``, or less when ``stop`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay_s):
            await stop.wait()
