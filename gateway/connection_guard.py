"""What a client connection may hold, and for how long: the pure policy.

Owns the limits on the gateway's HTTP connections (timeouts on what a client
owes, caps on how many connections there are, in all and per client address,
and a bound on the raw bytes one request may send) and the bookkeeping that
applies them: :class:`ConnectionCounts` (admission, in check/act pairs),
:class:`ConnectionClock` (one connection's phase and deadline) and
:class:`EventTally` (refusals and cuts, logged at a bounded rate). Nothing here
touches a socket; ``gateway/guarded_site.py`` is the aiohttp shell around it.
"""

from __future__ import annotations

import enum
import ipaddress
from collections import Counter
from dataclasses import dataclass

# What one request may send beyond its body: the request line, the headers
# (aiohttp's own limits keep them under ~1 MiB) and a chunked body's framing.
REQUEST_OVERHEAD_BYTES = 1 << 20


class CloseReason(enum.Enum):
    """Why a connection was refused at once, or closed before its time."""

    MAX_CONNECTIONS = "max_connections"
    MAX_CONNECTIONS_PER_ADDRESS = "max_connections_per_address"
    IDLE_TIMEOUT = "idle_timeout"
    HEADER_TIMEOUT = "header_timeout"
    BODY_TIMEOUT = "body_timeout"
    REQUEST_TOO_LARGE = "max_request_bytes"


class Phase(enum.Enum):
    """What a connection is waiting for."""

    # For a request's first byte: after connecting, or between keep-alive requests.
    IDLE = "idle"
    # For the rest of a request's headers, once its first byte came.
    HEADERS = "headers"
    # For the rest of a request's body, once its headers came.
    BODY = "body"
    # For the gateway's answer: the client owes nothing (a stream may run for minutes).
    HANDLING = "handling"
    # Nothing: a websocket now, kept alive (or not) by its own pings.
    UPGRADED = "upgraded"


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits on every HTTP connection of one gateway.

    Timeouts are in seconds and must be positive; a cap of 0 is no cap.
    Behind a reverse proxy or load balancer every client shares the proxy's
    address, so ``max_connections_per_address`` then caps the proxy."""

    idle_timeout_s: float
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_connections_per_address: int
    # The largest body a request may have (the gateway's max_frame_bytes).
    max_body_bytes: int
    overhead_bytes: int = REQUEST_OVERHEAD_BYTES

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_connections", "max_connections_per_address"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (no cap) or more, got {getattr(self, name)}")
        if self.max_body_bytes < 0 or self.overhead_bytes <= 0:
            raise ValueError("max_body_bytes must be >= 0 and overhead_bytes positive")

    @property
    def max_request_bytes(self) -> int:
        """The raw bytes one request may send, headers and framing included."""
        return self.max_body_bytes + self.overhead_bytes

    def timeout_s(self, phase: Phase) -> float | None:
        """How long ``phase`` may last (None: as long as it takes)."""
        if phase is Phase.IDLE:
            return self.idle_timeout_s
        if phase is Phase.HEADERS:
            return self.header_timeout_s
        if phase is Phase.BODY:
            return self.body_timeout_s
        return None


TIMEOUT_REASONS = {
    Phase.IDLE: CloseReason.IDLE_TIMEOUT,
    Phase.HEADERS: CloseReason.HEADER_TIMEOUT,
    Phase.BODY: CloseReason.BODY_TIMEOUT,
}


def address_key(host: str) -> str:
    """What ``max_connections_per_address`` counts a client by: its IPv4
    address, or its IPv6 /64 (one host commonly holds a whole /64)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # not an IP address: counted as it is
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class ConnectionCounts:
    """The open connections, in all and per client address."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self._limits = limits
        self._by_address: Counter[str] = Counter()
        self.num_connections = 0

    def num_from(self, address: str) -> int:
        """Open connections from ``address``."""
        return self._by_address[address]

    def refusal(self, address: str) -> CloseReason | None:
        """The cap one more connection from ``address`` would pass; None: it may open."""
        limits = self._limits
        if limits.max_connections and self.num_connections >= limits.max_connections:
            return CloseReason.MAX_CONNECTIONS
        per_address = limits.max_connections_per_address
        if per_address and self._by_address[address] >= per_address:
            return CloseReason.MAX_CONNECTIONS_PER_ADDRESS
        return None

    def admit(self, address: str) -> None:
        """Count a connection from ``address`` (which ``refusal`` let in)."""
        assert self.refusal(address) is None, f"{address} is over a cap"
        self._by_address[address] += 1
        self.num_connections += 1

    def release(self, address: str) -> None:
        """Forget one admitted connection from ``address``."""
        assert self._by_address[address] > 0, f"no connection from {address} to release"
        self._by_address[address] -= 1
        if not self._by_address[address]:
            del self._by_address[address]  # an address that left leaves nothing behind
        self.num_connections -= 1


class ConnectionClock:
    """One connection's phase, and when it must have moved on.

    Fed by the shell: bytes as they arrive, a request as the application
    takes it (its headers are then complete), its body's end, the answer's
    end, the switch to a websocket. Times are seconds on one monotonic clock."""

    def __init__(self, limits: ConnectionLimits, now_s: float) -> None:
        self._limits = limits
        self._idle_since_s = now_s
        self._headers_since_s: float | None = None
        self._body_since_s: float | None = None
        self._num_handling = 0
        self._upgraded = False
        # Raw bytes of the request being received, from its first byte to its body's end.
        self.request_bytes = 0

    @property
    def phase(self) -> Phase:
        if self._upgraded:
            return Phase.UPGRADED
        if self._body_since_s is not None:
            return Phase.BODY
        if self._num_handling:
            return Phase.HANDLING
        if self._headers_since_s is not None:
            return Phase.HEADERS
        return Phase.IDLE

    def deadline_s(self) -> float | None:
        """When the current phase times out (None: it does not)."""
        phase = self.phase
        since_s: float | None
        if phase is Phase.IDLE:
            since_s = self._idle_since_s
        elif phase is Phase.HEADERS:
            since_s = self._headers_since_s
        elif phase is Phase.BODY:
            since_s = self._body_since_s
        else:
            return None
        timeout_s = self._limits.timeout_s(phase)
        assert since_s is not None and timeout_s is not None
        return since_s + timeout_s

    def expired(self, now_s: float) -> CloseReason | None:
        """Why the connection must close at ``now_s``; None: not yet (or never)."""
        deadline_s = self.deadline_s()
        if deadline_s is None or now_s < deadline_s:
            return None
        return TIMEOUT_REASONS[self.phase]

    def can_receive(self, num_bytes: int) -> bool:
        """Whether ``num_bytes`` more keep the request within its byte bound."""
        return self._upgraded or self.request_bytes + num_bytes <= self._limits.max_request_bytes

    def receive(self, num_bytes: int, now_s: float) -> None:
        """``num_bytes`` arrived (``can_receive`` allowed them)."""
        if self._upgraded or not num_bytes:
            return
        assert self.can_receive(num_bytes), "over the request's byte bound"
        self.request_bytes += num_bytes
        # Bytes while an answer runs belong to a pipelined request: they
        # start no clock before that answer is done.
        if self.phase is Phase.IDLE:
            self._headers_since_s = now_s

    def start_request(self, body_complete: bool, now_s: float) -> None:
        """The application took a request: its headers are in."""
        self._headers_since_s = None
        self._num_handling += 1
        if body_complete:
            self.request_bytes = 0
        else:
            self._body_since_s = now_s

    def end_body(self) -> None:
        """The request's body came to its end."""
        self._body_since_s = None
        self.request_bytes = 0

    def end_request(self, now_s: float) -> None:
        """The application is done with a request: the connection idles from now."""
        assert self._num_handling > 0, "no request to end"
        self._num_handling -= 1
        if not self._num_handling:
            self._idle_since_s = now_s

    def upgrade(self) -> None:
        """The connection is a websocket now: no deadline, no byte bound."""
        self._upgraded = True


class EventTally:
    """Counts of events by reason, to log at most one line per reason per
    ``interval_s``: a flood of refusals is a few lines, not one a connection."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._held: Counter[CloseReason] = Counter()
        self._last_line_s: dict[CloseReason, float] = {}

    def note(self, reason: CloseReason, now_s: float) -> int:
        """Count one event; the number to log now (this one and those held
        since the last line), or 0 while within ``interval_s`` of the last line."""
        self._held[reason] += 1
        last_s = self._last_line_s.get(reason)
        if last_s is not None and now_s - last_s < self._interval_s:
            return 0
        self._last_line_s[reason] = now_s
        return self._held.pop(reason)
