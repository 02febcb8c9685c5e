"""The tokenizer's queue: prompts waiting for (or on) the tokenizer threads,
one queue per tenant, taken fairly, and bounded per tenant. Pure: no threads,
no asyncio; ``gateway/tokenizer_pool.py`` drives it from the event loop.

Fairness is the scheduler's (virtual token counters, VTC), counted in
characters: each tenant's counter grows by what its jobs cost, divided by
its weight, when a job starts; the next job is the oldest of the waiting
tenant with the smallest counter (the shorter job between equal ones). A
tenant that starts waiting again has its counter lifted to the virtual time,
the counter the latest job started at (start-time fair queueing), so time
idle is not banked as credit, and a newcomer goes before the next job of a
tenant that already has one on a thread. A job costs its characters plus
``JOB_OVERHEAD_CHARS``: a 100,000-character prompt costs what it costs, and a
stream of tiny ones is not free.

Bounds, on what waits or is being tokenized: per tenant in characters (one
tenant over its share is refused alone), and in all in jobs and characters
(memory). A job that finds its tenant's queue (or the whole queue) empty is
taken whatever its size, so no request is refused forever. (Refusals are
paced by ``gateway/refusal_pacer.py``, as every refusal of a tenant is.)
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from gateway.refusal import Refused

T = TypeVar("T")

# What one job costs beside its characters (the template, the hand-off to a
# thread), in characters: about what tokenizing this many takes.
JOB_OVERHEAD_CHARS = 256
BUSY_MESSAGE = "gateway busy, retry"


@dataclass(frozen=True)
class TokenizeQueueLimits:
    """What may wait for (or be on) the tokenizer threads."""

    # Jobs in all (a socket has at most one; an HTTP request is one).
    max_jobs: int = 1024
    # Characters in all: the memory the waiting prompts hold.
    max_chars: int = 8_000_000
    # Characters of one tenant: its share; past it, its new jobs are refused.
    max_chars_per_tenant: int = 1_000_000


class TokenizerQueueFull(Refused):
    """A job the queue does not take now (``queue_full``); ``message`` says
    whose queue is full."""

    def __init__(self, message: str) -> None:
        super().__init__("queue_full", message)


@dataclass(frozen=True)
class QueuedJob(Generic[T]):
    """One job as the queue knows it."""

    job: T
    tenant: str
    num_chars: int
    # Arrival order, to break ties between tenants' counters.
    sequence: int


class TokenizeQueue(Generic[T]):
    """Jobs by tenant; ``push`` (may refuse), ``pop`` the next to start,
    ``forget`` one that ended (or whose waiter gave up)."""

    def __init__(self, limits: TokenizeQueueLimits) -> None:
        self.limits = limits
        self._sequence = itertools.count()
        # Tenants with jobs waiting, each its jobs oldest first.
        self._waiting: dict[str, deque[QueuedJob[T]]] = {}
        # Every job waiting or started, not yet forgotten.
        self._jobs: dict[T, QueuedJob[T]] = {}
        self._started: set[T] = set()
        self._chars_by_tenant: dict[str, int] = {}
        self._num_chars = 0
        self._weights: dict[str, float] = {}
        self._counters: dict[str, float] = {}
        # The counter the latest job started at (the largest such, if a size
        # limit let a later one start first).
        self._virtual_time = 0.0

    @property
    def num_jobs(self) -> int:
        """Jobs waiting or started."""
        return len(self._jobs)

    @property
    def num_waiting(self) -> int:
        """Jobs waiting for a thread."""
        return len(self._jobs) - len(self._started)

    @property
    def num_chars(self) -> int:
        """Characters of the jobs waiting or started."""
        return self._num_chars

    def chars_of(self, tenant: str) -> int:
        """Characters of ``tenant``'s jobs waiting or started."""
        return self._chars_by_tenant.get(tenant, 0)

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter: characters started, divided by its weight."""
        return self._counters.get(tenant, 0.0)

    def check_room(self, tenant: str, num_chars: int) -> None:
        """Raise TokenizerQueueFull unless a job of ``tenant`` with ``num_chars``
        characters may be pushed now."""
        held = self.chars_of(tenant)
        if held and held + num_chars > self.limits.max_chars_per_tenant:
            raise TokenizerQueueFull(
                f"tenant {tenant!r}'s tokenizer queue is full ({held} characters waiting "
                f"or being tokenized, at most {self.limits.max_chars_per_tenant}), retry"
            )
        if self._jobs and (
            len(self._jobs) >= self.limits.max_jobs
            or self._num_chars + num_chars > self.limits.max_chars
        ):
            raise TokenizerQueueFull(BUSY_MESSAGE)

    def push(self, job: T, tenant: str, num_chars: int, weight: float = 1.0) -> None:
        """Queue ``job`` (hashable, not queued yet) behind ``tenant``'s others;
        raises TokenizerQueueFull (``check_room``) and then queues nothing."""
        assert job not in self._jobs, "a job is pushed once"
        assert weight > 0, "weights are validated where tenants are decoded"
        self.check_room(tenant, num_chars)
        queued = QueuedJob(job, tenant, num_chars, next(self._sequence))
        self._jobs[job] = queued
        if num_chars:
            self._chars_by_tenant[tenant] = self.chars_of(tenant) + num_chars
        self._num_chars += num_chars
        self._weights[tenant] = weight
        if tenant not in self._waiting:
            self._counters[tenant] = max(self.counter(tenant), self._virtual_time)
            self._waiting[tenant] = deque()
        self._waiting[tenant].append(queued)

    def pop(self, max_num_chars: int | None = None) -> QueuedJob[T] | None:
        """The job to start now, charged to its tenant: the oldest of the waiting
        tenant with the smallest counter, among the jobs of at most
        ``max_num_chars`` characters (None: any); None when there is none."""
        best: QueuedJob[T] | None = None
        for tenant, jobs in self._waiting.items():
            head = jobs[0]
            if max_num_chars is not None and head.num_chars > max_num_chars:
                continue  # owed its turn still: its counter is left as it is
            # Between equal counters (a tenant just lifted to another's), the
            # cheaper job first: a short prompt does not wait for a long one.
            if best is None or (self.counter(tenant), head.num_chars, head.sequence) < (
                self.counter(best.tenant),
                best.num_chars,
                best.sequence,
            ):
                best = head
        if best is None:
            return None
        tenant = best.tenant
        self._waiting[tenant].popleft()
        if not self._waiting[tenant]:
            del self._waiting[tenant]
        start = self.counter(tenant)
        self._virtual_time = max(self._virtual_time, start)
        self._counters[tenant] = (
            start + (best.num_chars + JOB_OVERHEAD_CHARS) / self._weights[tenant]
        )
        self._started.add(best.job)
        return best

    def forget(self, job: T) -> None:
        """``job`` ended, or its waiter gave up: it no longer counts (nor waits).
        Forgetting one twice, or one never pushed, does nothing."""
        queued = self._jobs.pop(job, None)
        if queued is None:
            return
        if job in self._started:
            self._started.discard(job)
        else:
            jobs = self._waiting[queued.tenant]
            jobs.remove(queued)
            if not jobs:
                del self._waiting[queued.tenant]
        # A tenant whose jobs hold no characters (token ids only) has no entry.
        held = self.chars_of(queued.tenant) - queued.num_chars
        if held > 0:
            self._chars_by_tenant[queued.tenant] = held
        else:
            self._chars_by_tenant.pop(queued.tenant, None)
        self._num_chars -= queued.num_chars
