"""Waiting requests in arrival order (``request`` and ``orca``)."""

from __future__ import annotations

import heapq

from scheduler_actor.config import SchedulerConfig
from scheduler_actor.policy import IsPreferred
from scheduler_actor.request import Request, RequestStatus


class FcfsQueue:
    """A heap by arrival sequence; cancelled entries are dropped lazily, so
    every operation is O(log n) and nothing scans the pool."""

    __slots__ = ("_heap", "num_waiting")

    def __init__(self) -> None:
        self._heap: list[tuple[int, Request]] = []
        self.num_waiting = 0

    def push(self, request: Request) -> None:
        """Add a waiting request (new, preempted or from a lost worker)."""
        heapq.heappush(self._heap, (request.arrival_seq, request))
        self.num_waiting += 1

    def peek(self) -> Request | None:
        """The earliest waiting request, if any."""
        heap = self._heap
        while heap and heap[0][1].status is not RequestStatus.WAITING:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def pop(self, request: Request) -> None:
        """Remove ``request``, which ``peek`` just returned."""
        assert self._heap and self._heap[0][1] is request
        heapq.heappop(self._heap)
        self.num_waiting -= 1

    def discard(self, request: Request) -> None:
        """Forget a waiting request that is being cancelled (its entry goes
        when it reaches the top)."""
        self.num_waiting -= 1


class ArrivalOrderPolicyBase:
    """The waiting-room half of the ``request`` and ``orca`` policies: one
    FCFS queue. Subclasses add ``fill`` (who runs each step)."""

    holds_results_until_batch_end = False

    def __init__(self, config: SchedulerConfig, is_preferred: IsPreferred) -> None:
        self._config = config
        self._is_preferred = is_preferred
        self._queue = FcfsQueue()

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted."""
        return self._queue.num_waiting

    def enqueue(self, request: Request) -> None:
        """Add a waiting request."""
        self._queue.push(request)

    def discard(self, request: Request) -> None:
        """Forget a cancelled waiting request."""
        self._queue.discard(request)
