"""Which actors (workers, gateways) have been silent too long: pure bookkeeping.

The actor reads heartbeat keys; this decides. An actor counts as alive when
first seen, so a newcomer gets a whole timeout before it can be declared gone.
"""

from __future__ import annotations


class Liveness:
    """When each actor was last seen alive, and who is gone for longer than ``timeout_s``."""

    __slots__ = ("_last_alive_s", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_alive_s: dict[str, float] = {}

    def alive(self, actor_id: str, now_s: float) -> None:
        """``actor_id`` showed a sign of life at ``now_s``."""
        self._last_alive_s[actor_id] = now_s

    def is_gone(self, actor_id: str, is_alive: bool, now_s: float) -> bool:
        """Record one heartbeat check; True when the actor has now been silent
        for longer than the timeout."""
        if is_alive:
            self._last_alive_s[actor_id] = now_s
            return False
        last_s = self._last_alive_s.setdefault(actor_id, now_s)
        return now_s - last_s > self.timeout_s

    def forget(self, actor_id: str) -> None:
        """Stop tracking ``actor_id`` (it left, or was declared gone)."""
        self._last_alive_s.pop(actor_id, None)

    def clear(self) -> None:
        """Forget everyone (a new incarnation starts over)."""
        self._last_alive_s.clear()
