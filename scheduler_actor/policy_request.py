"""``request``: request-level static batching (FasterTransformer), the baseline.

A batch of up to ``max_batch_size`` forms only when the worker is idle, each
member reserving prompt + max_tokens slots; nobody joins; everybody stays (and
keeps its K/V) until the longest finishes, and results are released then.
A tenant at its ``max_in_flight`` is passed over when a batch forms.
"""

from __future__ import annotations

from scheduler_actor.fcfs_queue import ArrivalOrderPolicyBase
from scheduler_actor.plan_builder import PlanBuilder


class RequestLevelPolicy(ArrivalOrderPolicyBase):
    """Static batches in arrival order."""

    holds_results_until_batch_end = True

    def fill(self, builder: PlanBuilder) -> None:
        """Form a batch on an idle worker, else step the current batch."""
        worker = builder.worker
        if not worker.placed and not worker.held:
            self._form_batch(builder)
            return
        for request in worker.placed.values():
            if not builder.can_continue(request):
                continue
            if request.wants_prefill():
                builder.prefill(request, len(request.context_ids) - request.num_prefill_planned)
            elif request.wants_decode():
                builder.decode(request)

    def _form_batch(self, builder: PlanBuilder) -> None:
        queue = self._queue
        while builder.num_scheduled < self._config.max_batch_size:
            request = queue.peek(self._tenants.can_run)
            if request is None or not self._is_preferred(builder.worker, request):
                return
            if not builder.can_reserve(request, request.num_max_context_tokens):
                return
            builder.place(request)
            builder.reserve(request, request.num_max_context_tokens)
            builder.prefill(request, len(request.context_ids) - request.num_prefill_planned)
