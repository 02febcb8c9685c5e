"""The gateway's table of sockets and requests: which socket (and under which
client id) each request's frames go to, which tenant each socket and request
belongs to, and how long a request stays known. Pure, no I/O.

The link between a request and its socket is kept here only, as one route per
request; the per-socket index of client ids is changed by the same two
methods (``_link``, ``_unlink``), so the two directions cannot disagree.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from gateway.request_stream import RequestStream
from gateway.tenants import Tenant


@dataclass(frozen=True)
class Route:
    """Where a request's frames go: a socket, under the client's id there."""

    socket_id: int
    client_id: str


@dataclass
class SocketEntry:
    """One open socket: who it authenticated as, and its requests by client id."""

    tenant: Tenant
    # sha256 of the API key its handshake presented (None: the open tenant).
    key_hash: str | None
    # False for an HTTP request's virtual socket: its requests cannot be resumed.
    resumable: bool = True
    requests: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PendingRequest:
    """A ``generate`` that passed the cheap checks and is being tokenized: its
    request id is reserved on its socket, so a cancel or a close meanwhile works."""

    request_id: str
    tenant: Tenant
    route: Route


class RequestTable:
    """Every open socket, every live request (attached or not), and the finished
    ones kept for ``resume`` during ``retention_s``."""

    def __init__(self, retention_s: float, clock: Callable[[], float]) -> None:
        self._retention_s = retention_s
        self._clock = clock
        self._next_socket_id = 0
        self._sockets: dict[int, SocketEntry] = {}
        # Live and recently finished requests (the latter kept for resume).
        self._streams: dict[str, RequestStream] = {}
        # Requests being tokenized: reserved, not yet accepted.
        self._pending: dict[str, PendingRequest] = {}
        # request id -> where its frames go; absent while detached.
        self._routes: dict[str, Route] = {}
        # Live (unfinished) requests, pending ones included, per tenant name.
        self._live: set[str] = set()
        self._live_by_tenant: Counter[str] = Counter()
        # (cancel_at_s, request_id) of requests whose socket closed, in closing order.
        self._detached: deque[tuple[float, str]] = deque()
        # (finished_at_s, request_id) in finishing order, so expiry is O(1) per request.
        self._finished: deque[tuple[float, str]] = deque()

    # --- sockets ---------------------------------------------------------------------

    def open_socket(self, tenant: Tenant, key_hash: str | None, *, resumable: bool = True) -> int:
        """A new socket; returns its id."""
        socket_id = self._next_socket_id
        self._next_socket_id += 1
        self._sockets[socket_id] = SocketEntry(
            tenant=tenant, key_hash=key_hash, resumable=resumable
        )
        return socket_id

    def close_socket(self, socket_id: int) -> tuple[list[RequestStream], list[PendingRequest]]:
        """Forget a socket; returns its live requests (now detached) and the
        pending ones (now dropped)."""
        entry = self._sockets.pop(socket_id, None)
        if entry is None:
            return [], []
        streams: list[RequestStream] = []
        dropped: list[PendingRequest] = []
        for request_id in list(entry.requests.values()):
            self._routes.pop(request_id, None)
            pending = self._pending.pop(request_id, None)
            if pending is not None:
                self._uncount(request_id, pending.tenant.name)
                dropped.append(pending)
            else:
                streams.append(self._streams[request_id])
        return streams, dropped

    def has_socket(self, socket_id: int) -> bool:
        """Whether ``socket_id`` is open."""
        return socket_id in self._sockets

    def socket(self, socket_id: int) -> SocketEntry:
        """An open socket's entry."""
        return self._sockets[socket_id]

    def sockets_without_key(self, valid_key_hashes: Collection[str]) -> list[int]:
        """The open sockets whose handshake used a key not in ``valid_key_hashes``
        (a revoked key); open-tenant sockets (no key) are never among them."""
        return [
            socket_id
            for socket_id, entry in self._sockets.items()
            if entry.key_hash is not None and entry.key_hash not in valid_key_hashes
        ]

    @property
    def num_sockets(self) -> int:
        """Open sockets."""
        return len(self._sockets)

    @property
    def num_attached(self) -> int:
        """Requests (pending or live) on open sockets."""
        return sum(len(entry.requests) for entry in self._sockets.values())

    def request_on(self, socket_id: int, client_id: str) -> str | None:
        """The request id ``client_id`` names on ``socket_id``, if any."""
        return self._sockets[socket_id].requests.get(client_id)

    def request_ids_on(self, socket_id: int) -> list[str]:
        """The ids of every request (pending or live) on one socket."""
        entry = self._sockets.get(socket_id)
        return [] if entry is None else list(entry.requests.values())

    def num_on_socket(self, socket_id: int) -> int:
        """Requests (pending or live) on one socket."""
        return len(self._sockets[socket_id].requests)

    def num_live_of_tenant(self, tenant: str) -> int:
        """A tenant's pending and live requests here, attached or detached."""
        return self._live_by_tenant[tenant]

    # --- requests --------------------------------------------------------------------

    def reserve(self, pending: PendingRequest) -> None:
        """Hold ``pending``'s id on its socket while it is tokenized."""
        self._pending[pending.request_id] = pending
        self._count(pending.request_id, pending.tenant.name)
        self._link(pending.request_id, pending.route)

    def take_pending(self, request_id: str) -> PendingRequest | None:
        """The pending request (removed from the table), None when it was
        cancelled or its socket closed meanwhile."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return None
        self._unlink(request_id)
        self._uncount(request_id, pending.tenant.name)
        return pending

    def is_pending(self, request_id: str) -> bool:
        """Whether ``request_id`` is being tokenized."""
        return request_id in self._pending

    @property
    def num_pending(self) -> int:
        """Requests being tokenized."""
        return len(self._pending)

    def add(self, stream: RequestStream, route: Route | None) -> None:
        """A new live request, sent to ``route`` (None: detached)."""
        self._streams[stream.request_id] = stream
        self._count(stream.request_id, stream.tenant)
        if route is not None:
            self._link(stream.request_id, route)
        if stream.finished:
            self.finish(stream)

    def stream(self, request_id: str) -> RequestStream | None:
        """A live or retained request, if known."""
        return self._streams.get(request_id)

    def live_streams(self) -> Iterator[RequestStream]:
        """Every request still running here."""
        return (s for s in self._streams.values() if not s.finished)

    def route(self, request_id: str) -> Route | None:
        """Where a request's frames go; None while detached."""
        return self._routes.get(request_id)

    def attach(self, stream: RequestStream, route: Route) -> None:
        """Send a live request's frames to ``route`` from now on (its old socket,
        if any, stops getting them and no longer detaches it on close)."""
        self._unlink(stream.request_id)
        self._link(stream.request_id, route)

    def detach_later(self, request_id: str, deadline_s: float) -> None:
        """Remember that a detached request is to be given up at ``deadline_s``."""
        self._detached.append((deadline_s, request_id))

    def due_detached(self, now_s: float) -> list[RequestStream]:
        """Detached live requests whose deadline passed, unresumed (taken off the list)."""
        due: list[RequestStream] = []
        while self._detached and self._detached[0][0] <= now_s:
            _, request_id = self._detached.popleft()
            stream = self._streams.get(request_id)
            if stream is not None and request_id not in self._routes and not stream.finished:
                due.append(stream)
        return due

    def finish(self, stream: RequestStream) -> None:
        """The request ended: it leaves its socket and stays for resume a while."""
        assert stream.finished_at_s is not None
        self._unlink(stream.request_id)
        if stream.request_id in self._live:
            self._uncount(stream.request_id, stream.tenant)
            self._finished.append((stream.finished_at_s, stream.request_id))

    def forget(self, stream: RequestStream) -> None:
        """The request is no business of this gateway any more."""
        self._unlink(stream.request_id)
        self._uncount(stream.request_id, stream.tenant)
        self._streams.pop(stream.request_id, None)

    def expire(self) -> None:
        """Forget the finished requests older than the retention."""
        horizon_s = self._clock() - self._retention_s
        while self._finished and self._finished[0][0] <= horizon_s:
            _, request_id = self._finished.popleft()
            stream = self._streams.get(request_id)
            if stream is not None and stream.finished:
                del self._streams[request_id]

    # --- the link, both ways, in one place -------------------------------------------

    def _link(self, request_id: str, route: Route) -> None:
        self._routes[request_id] = route
        self._sockets[route.socket_id].requests[route.client_id] = request_id

    def _unlink(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None and route.socket_id in self._sockets:
            self._sockets[route.socket_id].requests.pop(route.client_id, None)

    def _count(self, request_id: str, tenant: str) -> None:
        if request_id not in self._live:
            self._live.add(request_id)
            self._live_by_tenant[tenant] += 1

    def _uncount(self, request_id: str, tenant: str) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self._live_by_tenant[tenant] -= 1
            if not self._live_by_tenant[tenant]:
                del self._live_by_tenant[tenant]
