"""One connection's outbox: the bytes queued for it (a websocket's frames, an
HTTP response's server-sent events), bounded, and the writer task that sends
them in order.

The pub/sub reader that feeds every connection only ever queues here, so a
slow client never stalls the others; the byte cap keeps a client that stops
reading from holding the gateway's memory: over it, the connection is closed
(a websocket with 1013, try again later) and its requests detach or end as on
any close.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

OVERFLOW_REASON = "client too slow: its unread frames went over the limit"


class Outbox:
    """Frames for one socket, at most ``max_bytes`` of them unsent. Two tasks
    serve it: ``write_to`` sends, ``close_on_overflow`` closes the socket once
    over the cap (the writer may be stuck on a peer that never reads)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._frames: deque[bytes] = deque()
        self._num_bytes = 0
        self._ready = asyncio.Event()
        # Set on close or overflow: the end of both tasks.
        self._ended = asyncio.Event()
        self._closed = False
        self.overflowed = False

    @property
    def is_empty(self) -> bool:
        """Nothing left to send."""
        return not self._frames

    @property
    def num_bytes(self) -> int:
        """Bytes queued and not yet handed to the socket."""
        return self._num_bytes

    def put(self, frame: bytes) -> bool:
        """Queue ``frame`` (the UTF-8 of one text frame); False (and nothing
        queued) once over the cap: the socket is then being closed."""
        if self._closed or self.overflowed:
            return False
        if self._num_bytes + len(frame) > self._max_bytes:
            # What is queued goes nowhere: the socket closes, a resume replays it.
            self.overflowed = True
            self._frames.clear()
            self._num_bytes = 0
            self._ready.set()
            self._ended.set()
            return False
        self._frames.append(frame)
        self._num_bytes += len(frame)
        self._ready.set()
        return True

    def close(self) -> None:
        """No more frames: the writer sends what is queued, then ends."""
        self._closed = True
        self._ready.set()
        self._ended.set()

    async def write_to(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Send the frames in order with ``send`` until ``close`` (or an
        overflow), or until ``send`` finds the connection gone."""
        while not self.overflowed:
            await self._ready.wait()
            self._ready.clear()
            while self._frames and not self.overflowed:
                frame = self._frames.popleft()
                self._num_bytes -= len(frame)
                try:
                    await send(frame)
                except ConnectionError:
                    return
            if self._closed and not self._frames:
                return

    async def close_on_overflow(self, close: Callable[[], Awaitable[object]]) -> None:
        """Close the connection with ``close`` once over the cap; end with the
        outbox otherwise."""
        await self._ended.wait()
        if self.overflowed:
            await close()
