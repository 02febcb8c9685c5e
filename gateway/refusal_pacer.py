"""Pacing of a tenant's refused ``generate`` requests, by the characters of
their prompts. Pure; the time is passed in.

A refusal is cheap for the client and not for the gateway, which has read
and checked a frame of up to 100,000 characters: a client that resends at
once on 64 sockets can have 1,500 such frames a second read and refused, and
slow every other client's tokens on the same event loop. So a tenant's
refusals are answered no faster than ``max_chars_per_s`` characters of
refused prompts a second: a refusal waits for the ones before it, and its
socket reads nothing meanwhile (``gateway/actions.py``'s ``Wait``). A client
refused now and then, or for a short prompt, waits for nothing.
"""

from __future__ import annotations


class RefusalPacer:
    """When each tenant's next refusal may be answered."""

    def __init__(self, max_chars_per_s: float) -> None:
        assert max_chars_per_s > 0
        self._max_chars_per_s = max_chars_per_s
        # Per tenant: when what was refused so far has been paid for.
        self._paid_until_s: dict[str, float] = {}

    def delay_s(self, tenant: str, num_chars: int, now_s: float) -> float:
        """How long to hold the refusal, made at ``now_s``, of a prompt of
        ``num_chars`` characters of ``tenant`` before it is answered: until the
        refusals before it have been paid for (0 when they have)."""
        due_s = max(now_s, self._paid_until_s.get(tenant, now_s))
        # Tenants whose refusals are all paid for are forgotten: the table
        # holds only those refused within the last moments.
        self._paid_until_s = {
            name: until_s for name, until_s in self._paid_until_s.items() if until_s > now_s
        }
        self._paid_until_s[tenant] = due_s + num_chars / self._max_chars_per_s
        return due_s - now_s
