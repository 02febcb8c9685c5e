"""What the scheduler knows of one worker: its blocks, requests and plans."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_actor.block_ledger import BlockLedger
from scheduler_actor.request import Request


@dataclass(eq=False, slots=True)
class WorkerState:
    """One worker as mirrored by the scheduler.

    ``placed`` holds the requests whose K/V lives on this worker, in placement
    order; ``outstanding`` maps the step index of every plan sent but not yet
    answered to the requests in it; ``held`` keeps finished requests whose
    results wait for the end of their batch (``request`` policy).
    """

    worker_id: str
    join_seq: int
    max_inflight: int
    ledger: BlockLedger
    placed: dict[str, Request] = field(default_factory=dict)
    held: list[Request] = field(default_factory=list)
    outstanding: dict[int, list[Request]] = field(default_factory=dict)
    pending_release_ids: list[str] = field(default_factory=list)

    def can_plan(self) -> bool:
        """Whether another plan may be sent before a result returns."""
        return len(self.outstanding) < self.max_inflight
