"""The scheduler's live view (``shared/live_stats.py``): each worker's recent
iterations, and snapshots of what the core knows, for the dashboard.

Pure and bounded. The shell records every plan it sends and every result
that comes back; the rest of a snapshot (blocks, requests, tenants) is read
from the core when it is taken, so the view holds no second copy that could
drift. See docs/scheduler.md, *Live view*.
"""

from __future__ import annotations

import heapq
from collections import deque

import msgspec

from scheduler_actor.config import PolicyName
from scheduler_actor.core import Scheduler
from shared.live_stats import (
    MAX_STEPS_PER_WORKER,
    MAX_TENANTS,
    LiveSnapshot,
    StepRecord,
    TenantLive,
    WorkerLive,
)
from shared.messages import StepOutput, StepPlan


class LiveView:
    """The last ``MAX_STEPS_PER_WORKER`` iterations of every worker, as planned
    and as they came back; one per core (step indices restart with a new one)."""

    __slots__ = ("_steps",)

    def __init__(self) -> None:
        # Worker id -> its iterations, oldest first (step indices ascending).
        self._steps: dict[str, deque[StepRecord]] = {}

    def record_plan(self, plan: StepPlan) -> None:
        """A plan the shell sends to its worker."""
        steps = self._steps.get(plan.worker_id)
        if steps is None:
            steps = self._steps[plan.worker_id] = deque(maxlen=MAX_STEPS_PER_WORKER)
        steps.append(
            StepRecord(
                step_index=plan.step_index,
                # A request is in a plan once: with one prefill chunk or one decode.
                num_requests=len(plan.prefill_chunks) + len(plan.decode_request_ids),
                num_prefill_tokens=sum(len(chunk.token_ids) for chunk in plan.prefill_chunks),
                num_decode_tokens=len(plan.decode_request_ids),
                num_joined=len(plan.new_requests),
                # Cancels and preemptions; the requests this step finishes are
                # added when its result comes back.
                num_left=len(plan.released_request_ids),
                step_ms=None,
            )
        )

    def record_output(self, output: StepOutput, num_finished: int) -> None:
        """A worker's result of one recorded plan: its forward time, and the
        ``num_finished`` requests the core released because of it (finished,
        failed, or a whole batch under ``request``). Results of plans no
        longer in the view are ignored."""
        steps = self._steps.get(output.worker_id)
        if steps is None:
            return
        # Results come back in plan order, so the plan is near the newest end.
        for position in range(len(steps) - 1, -1, -1):
            record = steps[position]
            if record.step_index < output.step_index:
                return
            if record.step_index == output.step_index:
                if record.step_ms is None:  # a result is counted once
                    steps[position] = msgspec.structs.replace(
                        record,
                        step_ms=output.step_ms,
                        num_left=record.num_left + num_finished,
                        path=output.path,
                        stage_ms=output.stage_ms,
                    )
                return

    def snapshot(self, core: Scheduler, now_ms: int) -> LiveSnapshot:
        """What ``core`` knows now, with each worker's recorded iterations;
        ``now_ms`` is the wall clock. Workers the core no longer knows are
        forgotten here (their iterations go with them)."""
        workers = core.workers
        for worker_id in [worker_id for worker_id in self._steps if worker_id not in workers]:
            del self._steps[worker_id]
        worker_views = [
            WorkerLive(
                worker_id=worker_id,
                blocks_used=worker.ledger.num_used,
                blocks_cached=worker.ledger.num_evictable,
                blocks_total=worker.ledger.num_blocks,
                num_running=len(worker.placed),
                steps=list(self._steps.get(worker_id, ())),
                pipeline_depth=worker.pipeline_depth,
            )
            for worker_id, worker in workers.items()
        ]
        return LiveSnapshot(
            time_ms=now_ms,
            policy=core.config.policy.value,
            num_waiting=core.num_waiting,
            workers=worker_views,
            tenants=_tenants(core),
        )


def _tenants(core: Scheduler) -> list[TenantLive]:
    """The ``MAX_TENANTS`` tenants with a live request and the most service
    (ties by name), with the tenant ledger's counts, which admission uses."""
    ledger = core.tenants
    # The counter orders admissions only under ``fair``; elsewhere it means nothing.
    is_fair = core.config.policy is PolicyName.FAIR
    vtc = core.vtc
    services = [(vtc.counter(tenant) if is_fair else 0.0, tenant) for tenant in ledger.active()]
    top = heapq.nsmallest(MAX_TENANTS, services, key=lambda item: (-item[0], item[1]))
    return [
        TenantLive(
            tenant=tenant,
            service=service,
            num_waiting=ledger.num_waiting(tenant),
            num_running=ledger.num_running(tenant),
        )
        for service, tenant in top
    ]
