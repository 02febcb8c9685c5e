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
    answered to the requests in it (a worker group of ``pipeline_depth`` stages
    keeps one plan per stage in flight, each a batch of its own); ``held`` keeps
    finished requests whose results wait for the end of their batch (``request``
    policy).
    """

    worker_id: str
    join_seq: int
    max_inflight: int
    ledger: BlockLedger
    pipeline_depth: int = 1
    placed: dict[str, Request] = field(default_factory=dict)
    held: list[Request] = field(default_factory=list)
    outstanding: dict[int, list[Request]] = field(default_factory=dict)
    pending_release_ids: list[str] = field(default_factory=list)

    @property
    def max_plans_per_request(self) -> int:
        """Outstanding plans of this worker one request may be in: every one (the
        engine runs them in order and knows what the earlier ones sampled), but
        one in a pipeline, whose next input comes back from its last stage."""
        return 1 if self.pipeline_depth > 1 else self.max_inflight

    def can_plan(self) -> bool:
        """Whether another plan may be sent before a result returns."""
        return len(self.outstanding) < self.max_inflight
