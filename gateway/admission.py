"""Admission: every check a ``generate`` (or a ``resume`` onto a socket) passes
before the gateway takes it on, and the caps behind them. Pure.

The caps: draining refuses everything new; a socket holds at most
``max_requests_per_socket`` requests; a tenant at most
``max_requests_per_tenant`` on this gateway, attached or detached (a client
that opens and drops sockets cannot pile up requests); a tenant's
``max_tokens_per_request``; a request that could never fit its tenant's
tokens per minute (judged before tokenizing from a lower bound on its
tokens, ``validation.min_request_tokens``, and again after); and, applied by
the scheduler, ``default_max_queued`` for a tenant whose record sets no
``max_queued``. The per-minute budget itself is taken in Redis by the shell
(``gateway/upstream.py``), the only place all gateways share. What may wait
for the tokenizer, per tenant and in all, is the tokenizer queue's to bound
(``gateway/tokenize_queue.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from gateway.refusal import Refused
from gateway.request_table import RequestTable
from gateway.tenants import Tenant, TokenReservation
from shared.messages import TenantLimits
from shared.protocol import Generate

SHUTTING_DOWN_MESSAGE = "gateway is shutting down, reconnect elsewhere"


@dataclass(frozen=True)
class AdmissionLimits:
    """The gateway's own caps (the tenant's come with its ``Tenant``)."""

    max_requests_per_socket: int = 64
    max_requests_per_tenant: int = 256
    # The scheduler's max_queued for a tenant whose record sets none.
    default_max_queued: int | None = 256


class AdmissionRefused(Refused):
    """A request the gateway does not take on (``gateway/refusal.py``)."""


class Admission:
    """The checks, in the order a client is best served by: what can never
    succeed (``invalid_request``) before what may succeed later (``queue_full``)."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.draining = False

    def check_generate(self, table: RequestTable, socket_id: int, generate: Generate) -> None:
        """Raise AdmissionRefused when ``generate`` is refused whatever the load
        (or the gateway is draining); the caps come after the request's own
        checks (``check_capacity``), so a request that can never succeed is
        not told to retry later."""
        if self.draining:
            # The one place draining refuses a request, on either protocol.
            raise AdmissionRefused("queue_full", SHUTTING_DOWN_MESSAGE, reason="shutting_down")
        if table.request_on(socket_id, generate.id) is not None:
            raise AdmissionRefused(
                "invalid_request",
                f"a request with id {generate.id!r} is already in flight on this socket",
            )
        tenant = table.socket(socket_id).tenant
        cap = tenant.max_tokens_per_request
        # A null max_tokens is settled after tokenizing (gateway/validation.py); it
        # comes to at least min_tokens.
        for name, value in (
            ("max_tokens", generate.max_tokens),
            ("min_tokens", generate.min_tokens),
        ):
            if cap is not None and value is not None and value > cap:
                raise AdmissionRefused(
                    "invalid_request",
                    f"{name} {value} is over tenant {tenant.name!r}'s max_tokens limit of {cap}",
                    param=name,
                )

    def check_tokens_per_minute(self, tenant: Tenant, min_num_tokens: int) -> None:
        """Raise AdmissionRefused when a request of at least ``min_num_tokens``
        (prompt + max_tokens, before tokenizing: a lower bound) is more than a
        whole minute's budget of its tenant: it could never run."""
        if tenant.tokens_per_minute is not None and min_num_tokens > tenant.tokens_per_minute:
            raise AdmissionRefused(
                "invalid_request",
                f"prompt plus max_tokens is at least {min_num_tokens} tokens, more than "
                f"tenant {tenant.name!r}'s tokens-per-minute limit of {tenant.tokens_per_minute}",
                param="prompt",
            )

    def check_capacity(self, table: RequestTable, socket_id: int) -> None:
        """Raise AdmissionRefused unless the socket and its tenant have room for
        a new request (the tokenizer queue's room is checked when it is queued)."""
        self.check_socket_room(table, socket_id)
        self.check_tenant_room(table, table.socket(socket_id).tenant)

    def check_socket_room(self, table: RequestTable, socket_id: int) -> None:
        """Raise AdmissionRefused when the socket holds as many requests as it may."""
        if table.num_on_socket(socket_id) >= self.limits.max_requests_per_socket:
            raise AdmissionRefused(
                "queue_full",
                f"this socket already has {self.limits.max_requests_per_socket} requests in "
                "flight (the most allowed)",
            )

    def check_tenant_room(self, table: RequestTable, tenant: Tenant) -> None:
        """Raise AdmissionRefused when the tenant holds as many requests here as it may."""
        if table.num_live_of_tenant(tenant.name) >= self.limits.max_requests_per_tenant:
            raise AdmissionRefused(
                "queue_full",
                f"tenant {tenant.name!r} already has {self.limits.max_requests_per_tenant} "
                "requests in flight on this gateway (the most allowed)",
            )

    def reservation(self, tenant: Tenant, num_tokens: int) -> TokenReservation | None:
        """What a request of ``num_tokens`` (prompt + max_tokens) takes of its
        tenant's per-minute budget (None: no budget); raises AdmissionRefused
        when it is more than a whole minute's budget (it could never run)."""
        if tenant.tokens_per_minute is None:
            return None
        if num_tokens > tenant.tokens_per_minute:
            raise AdmissionRefused(
                "invalid_request",
                f"prompt plus max_tokens is {num_tokens} tokens, more than tenant "
                f"{tenant.name!r}'s tokens-per-minute limit of {tenant.tokens_per_minute}",
                param="prompt",
            )
        return TokenReservation(
            tenant=tenant.name, num_tokens=num_tokens, tokens_per_minute=tenant.tokens_per_minute
        )

    def scheduler_limits(self, tenant: Tenant) -> TenantLimits:
        """What the scheduler enforces for ``tenant``'s requests: its own limits,
        with the default ``max_queued`` where it sets none (so no tenant fills
        the scheduler's global queue alone)."""
        limits = tenant.limits
        if limits.max_queued is None and self.limits.default_max_queued is not None:
            return msgspec.structs.replace(limits, max_queued=self.limits.default_max_queued)
        return limits
