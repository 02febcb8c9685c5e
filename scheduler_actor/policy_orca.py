"""``orca``: Algorithm 1 of the Orca paper (OSDI'22), iteration-level FCFS.

Every step selects, in arrival order, up to ``max_batch_size`` requests that
are not running; a request scheduled for the first time reserves prompt +
max_tokens slots, and admission stops (never skips ahead) at the first
reservation that fails. Whole prompts run in one iteration.

Already placed requests keep their reservation, so they are still selected
after admission stops: in the paper's setting every placed request arrived
before every waiting one, and this is Algorithm 1 exactly; it only differs
when a lost worker sends an old request back to waiting, where stopping the
placed ones too could deadlock. A tenant at its ``max_in_flight`` is passed
over (its requests wait, the others keep their arrival order).
"""

from __future__ import annotations

from scheduler_actor.fcfs_queue import ArrivalOrderPolicyBase
from scheduler_actor.plan_builder import PlanBuilder
from scheduler_actor.request import Request


class OrcaPolicy(ArrivalOrderPolicyBase):
    """Iteration-level FCFS with up-front reservation."""

    def fill(self, builder: PlanBuilder) -> None:
        """Select(pool, n_rsrv) for one worker."""
        max_batch_size = self._config.max_batch_size
        # Placed requests are bounded by the batch size (times max_inflight),
        # so sorting them is O(batch), never O(pool).
        placed = [
            request
            for request in builder.worker.placed.values()
            if builder.can_continue(request) and (request.wants_prefill() or request.wants_decode())
        ]
        placed.sort(key=_arrival_seq)
        queue = self._queue
        can_run = self._tenants.can_run
        # Only a placement changes the queue's head (or a tenant's can_run), so
        # it is looked up once per admission, not once per placed request.
        head = queue.peek(can_run)
        index = 0
        while builder.num_scheduled < max_batch_size:
            if index < len(placed) and (
                head is None or placed[index].arrival_seq < head.arrival_seq
            ):
                if builder.can_continue(placed[index]):  # a pipeline's share may be full
                    self._step(builder, placed[index])
                index += 1
            elif head is not None:
                if not self._is_preferred(builder.worker, head) or not builder.can_reserve(
                    head, head.num_max_context_tokens
                ):
                    head = None  # admission stops at the first reservation that fails
                    continue
                builder.place(head)
                builder.reserve(head, head.num_max_context_tokens)
                self._step(builder, head)
                head = queue.peek(can_run)
            else:
                return

    @staticmethod
    def _step(builder: PlanBuilder, request: Request) -> None:
        if request.wants_prefill():
            builder.prefill(request, len(request.context_ids) - request.num_prefill_planned)
        else:
            builder.decode(request)


def _arrival_seq(request: Request) -> int:
    return request.arrival_seq
