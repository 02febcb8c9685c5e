"""The handshake's decision, for a websocket and for every HTTP request: who
a connection is (its API key and tenant), whether it addressed us by a name
we answer to (``Host``), whether its page may talk to us (``Origin``), and
which subprotocol the server selects. Pure: headers in, a tenant or a
refusal out.

``Host`` defends a keyless gateway against DNS rebinding: a page on
``attacker.example`` whose name then resolves to 127.0.0.1 is same-origin
with the gateway as far as the browser knows, and sends ``Host:
attacker.example``. Only names that no outsider controls are answered (IP
literals, ``localhost``, this machine's own names, ``--allowed-host``).

A key comes as ``Authorization: Bearer <key>`` or, where a browser cannot set
headers, as the subprotocols ``["orcapod", "bearer.<key>"]`` (the server then
selects ``orcapod``, never the one holding the key: ``SUBPROTOCOL`` is the
only one the server offers). The open tenant exists
only when the gateway decided so at start (``open_tenant``); keys that go
away later never open the gateway.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from http import HTTPStatus

from websockets.datastructures import Headers, MultipleValuesError
from websockets.exceptions import InvalidHeader
from websockets.headers import parse_subprotocol
from websockets.typing import Subprotocol

from gateway.tenants import Tenant, TenantTable, hash_key

SUBPROTOCOL = "orcapod"
BEARER_SUBPROTOCOL_PREFIX = "bearer."
# ``--allowed-host *``: answer any name (a gateway whose every client has a key).
ANY_HOST = "*"


@dataclass(frozen=True)
class Admitted:
    """A handshake that may open a socket, as ``tenant``."""

    tenant: Tenant
    # sha256 of the key it presented (None: the open tenant): a revoked key
    # closes the sockets that used it.
    key_hash: str | None


class HandshakeRefused(Exception):
    """A handshake that does not open a socket: the HTTP status and body to answer."""

    def __init__(self, status: HTTPStatus, body: str, *, challenge: bool = False) -> None:
        super().__init__(body)
        self.status = status
        self.body = body
        # A 401 names the scheme the client should use.
        self.challenge = challenge


class AuthError(HandshakeRefused):
    """A handshake without a valid API key (401)."""

    def __init__(self, body: str) -> None:
        super().__init__(HTTPStatus.UNAUTHORIZED, body, challenge=True)


def decide(
    headers: Headers,
    table: TenantTable,
    *,
    open_tenant: Tenant | None,
    allowed_origins: Collection[str],
) -> Admitted:
    """Who the handshake with ``headers`` is; raises HandshakeRefused (400 for
    a repeated header, 403 for a foreign origin, 401 without a valid key).
    ``Host`` was checked before (``check_host``, for every request)."""
    check_origin(single_header(headers, "Origin"), single_header(headers, "Host"), allowed_origins)
    key = presented_key(single_header(headers, "Authorization"), offered_subprotocols(headers))
    tenant = authenticate(table, key, open_tenant=open_tenant)
    return Admitted(tenant=tenant, key_hash=None if key is None else hash_key(key))


def single_header(headers: Headers, name: str) -> str | None:
    """The one value of header ``name`` (None when absent); raises
    HandshakeRefused (400) when it comes more than once: which one counts
    would be a guess, and a proxy may have guessed the other way."""
    try:
        return headers.get(name)
    except MultipleValuesError:
        raise HandshakeRefused(
            HTTPStatus.BAD_REQUEST, f"the {name} header may come only once\n"
        ) from None


def check_host(host: str | None, own_names: Collection[str], allowed: Collection[str]) -> None:
    """Refuse (403) a request that names this gateway by a name it does not answer to.

    Answered: IP literals (a rebinding attack needs a name it controls),
    ``localhost`` and ``*.localhost`` (browsers resolve them to loopback
    themselves), ``own_names`` (the bound host, this machine's names), and
    ``allowed`` (``--allowed-host``; ``*`` answers any). No ``Host`` at all is
    an HTTP/1.0 client, not a browser: it passes.
    """
    if host is None or ANY_HOST in allowed:
        return
    name = host_name(host)
    if not name:
        raise HandshakeRefused(HTTPStatus.BAD_REQUEST, "malformed Host header\n")
    if _is_ip_literal(name) or name == "localhost" or name.endswith(".localhost"):
        return
    answered = {entry.strip().rstrip(".").lower() for entry in (*own_names, *allowed)}
    if name not in answered:
        raise HandshakeRefused(
            HTTPStatus.FORBIDDEN,
            f"this gateway does not answer to the name {name!r} "
            "(see the gateway's --allowed-host)\n",
        )


def host_name(host: str) -> str:
    """The name or address in a ``Host`` header, without its port, lowercased
    (an IPv6 literal without its brackets)."""
    host = host.strip().lower()
    if host.startswith("["):
        address, bracket, _ = host[1:].partition("]")
        return address if bracket else ""
    name, _, _ = host.partition(":")
    return name.rstrip(".")


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_origin(origin: str | None, host: str | None, allowed: Collection[str]) -> None:
    """Refuse (403) a browser's handshake from a page of another site.

    Browsers send ``Origin`` on every websocket handshake and let any page open
    one to any address, localhost included; other clients send none and pass.
    A page may come from the host it connects to (the gateway's own pages;
    ``Host`` passed ``check_host`` first) or from an origin in ``allowed``.
    """
    if origin is None:
        return
    normalized = origin.strip().rstrip("/").lower()
    permitted = {entry.strip().rstrip("/").lower() for entry in allowed}
    if host:
        permitted |= {f"http://{host.strip().lower()}", f"https://{host.strip().lower()}"}
    if normalized not in permitted:
        raise HandshakeRefused(
            HTTPStatus.FORBIDDEN, "origin not allowed (see the gateway's --allowed-origin)\n"
        )


def presented_key(authorization: str | None, subprotocols: Sequence[str]) -> str | None:
    """The key a handshake presents: ``Authorization: Bearer <key>``, else a
    ``bearer.<key>`` subprotocol; None when it presents none."""
    if authorization is not None:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return credentials.strip()
    for subprotocol in subprotocols:
        if subprotocol.startswith(BEARER_SUBPROTOCOL_PREFIX):
            key = subprotocol[len(BEARER_SUBPROTOCOL_PREFIX) :]
            if key:
                return key
    return None


def authenticate(table: TenantTable, key: str | None, *, open_tenant: Tenant | None) -> Tenant:
    """The tenant a handshake acts as; raises AuthError (a 401) when it has none.

    With an ``open_tenant`` (decided at start), a handshake without a key is
    that tenant, and so is one with a key while no key is configured (a
    client that always sends its key still reaches a keyless local gateway);
    otherwise a key must be a valid one. Without an open tenant nothing
    changes that: a table whose keys all went away refuses everyone.
    """
    if open_tenant is not None and (key is None or table.num_keys == 0):
        return open_tenant
    if key is None:
        raise AuthError(
            "missing API key: send `Authorization: Bearer <key>` "
            f"or the subprotocols {SUBPROTOCOL!r} and '{BEARER_SUBPROTOCOL_PREFIX}<key>'\n"
        )
    tenant = table.lookup(key)
    if tenant is None:
        raise AuthError("invalid API key\n")
    return tenant


def offered_subprotocols(headers: Headers) -> list[Subprotocol]:
    """The subprotocols a handshake offers (none when the header is malformed)."""
    offered: list[Subprotocol] = []
    for value in headers.get_all("Sec-WebSocket-Protocol"):
        try:
            offered += parse_subprotocol(value)
        except InvalidHeader:
            return []
    return offered
