"""Running the scheduler's plans on one engine: everything that reads or
changes engine state, on the engine's own thread (or process).

Fencing: plans of an epoch older than the newest seen are skipped (a dead
letter says so); the first plan of a newer epoch drops every request of the
old scheduler first. Within an epoch, each plan's step index must come after
the last one run, or the plan is refused whole. A plan the engine refuses
(``PlanError``) changes nothing and gets an empty output; one that raises
anything else fails the requests it names. The output's tokens are routed to
their gateways here, so the publisher only sends.

Pure of I/O: a plan in, a ``StepDone`` out (a msgspec Struct, so it crosses
from the engine process to the worker's Redis shell as bytes).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import msgspec
import structlog

from gpu_worker.engine import (
    STEP_FAILED_MESSAGE,
    Engine,
    PlanError,
    PreparedStep,
    StepOutcome,
)
from gpu_worker.step_done import EngineCounters, GatewayFailure, StepDone
from shared.messages import (
    RequestFailure,
    SampledToken,
    StepOutput,
    StepPlan,
    StepTiming,
    encode,
)

SUMMARY_EVERY_STEPS = 200

_log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StartedPlan:
    """A plan past its fences and ``Engine.begin_step``, its forward pass to come."""

    entry_id: bytes
    plan: StepPlan
    received_at: float
    started_at: float
    prepared: PreparedStep


class PlanRunner:
    """One engine's plans, in order; its epoch fence and its requests' gateways."""

    def __init__(self, engine: Engine, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.epoch = 0
        self._gateway_ids: dict[str, str] = {}
        self._last_step_index = -1  # of this epoch's plans: each must come after the last
        self._last_step_end_s: float | None = None
        self._window_started_s = time.monotonic()
        self._window_busy_s = 0.0
        self._num_steps = 0

    def run(self, entry_id: bytes, plan: StepPlan, received_at: float) -> StepDone:
        """Run one plan (read at ``received_at``) on this engine; never raises for
        what a plan holds: anything unexpected fails the plan's requests."""
        started = self.start(entry_id, plan, received_at)
        if isinstance(started, StepDone):
            return started
        begun_s = time.perf_counter()
        try:
            outcome = self.engine.compute(started.prepared)
        except Exception:  # any fault of the forward ends its step, not the worker
            _log.exception(
                "step_failed",
                step_index=plan.step_index,
                num_requests=len(started.prepared.works),
            )
            outcome = None
        return self.finish(started, outcome, (time.perf_counter() - begun_s) * 1000)

    def start(self, entry_id: bytes, plan: StepPlan, received_at: float) -> StepDone | StartedPlan:
        """A plan's fences and changes of state; its ``StepDone`` at once where no
        forward pass runs (stale, refused, nothing to compute), else the step to
        compute and hand to ``finish``: here (``run``) or down a pipeline."""
        started_at = time.time()
        try:
            begun = self._begin_plan(entry_id, plan)
        except Exception:  # a bug: this plan's requests end, the worker goes on
            _log.exception("plan_failed", step_index=plan.step_index, epoch=plan.epoch)
            begun = self._fail_plan(entry_id, plan)
        if isinstance(begun, PreparedStep):
            return StartedPlan(entry_id, plan, received_at, started_at, begun)
        if isinstance(begun, StepOutput):
            begun = self._routed(entry_id, plan, begun)
        return self._stamped(begun, plan, received_at, started_at)

    def finish(self, started: StartedPlan, outcome: StepOutcome | None, step_ms: float) -> StepDone:
        """A started plan's ``StepDone`` from what its forward and sampler made of it
        (``outcome`` None: the forward failed, and so do the step's requests)."""
        plan = started.plan
        try:
            output = self.engine.finish_step(started.prepared, outcome, step_ms)
            done = self._routed(started.entry_id, plan, output)
        except Exception:  # a bug: this plan's requests end, the worker goes on
            _log.exception("plan_failed", step_index=plan.step_index, epoch=plan.epoch)
            done = self._fail_plan(started.entry_id, plan)
        return self._stamped(done, plan, started.received_at, started.started_at)

    def _stamped(
        self, done: StepDone, plan: StepPlan, received_at: float, started_at: float
    ) -> StepDone:
        """``done`` with its step's timing (where it computed tokens) and the engine's counters."""
        output = done.output
        if output is not None and output.num_new_tokens:
            timing = StepTiming(
                planned_at=plan.planned_at,
                received_at=received_at,
                started_at=started_at,
                ended_at=time.time(),
                forward_s=output.step_ms / 1000,
            )
            done = msgspec.structs.replace(
                done, output=msgspec.structs.replace(output, timing=timing)
            )
        stats = self.engine.stats
        counters = EngineCounters(stats.num_steps, stats.num_tokens, stats.busy_s)
        return msgspec.structs.replace(done, counters=counters)

    def _fail_plan(self, entry_id: bytes, plan: StepPlan) -> StepDone:
        """Every request the plan names ends with an error (the engine may not
        hold all of them: the scheduler still does); the plan goes to dead."""
        request_ids = list(
            dict.fromkeys(
                [
                    *(spec.request_id for spec in plan.new_requests),
                    *(chunk.request_id for chunk in plan.prefill_chunks),
                    *plan.decode_request_ids,
                ]
            )
        )
        try:
            self.engine.fail_requests(request_ids, STEP_FAILED_MESSAGE)
        except Exception:  # best effort: the engine's state is suspect already
            _log.exception("failed_requests_not_dropped", request_ids=request_ids)
        for spec in plan.new_requests:
            self._gateway_ids.setdefault(spec.request_id, spec.gateway_id)
        failed = [RequestFailure(rid, STEP_FAILED_MESSAGE) for rid in request_ids]
        output = StepOutput(
            worker_id=self.worker_id, epoch=plan.epoch, step_index=plan.step_index, failed=failed
        )
        failures = [GatewayFailure(self._gateway_ids.pop(f.request_id, ""), f) for f in failed]
        return StepDone(
            entry_id,
            output,
            dead_error="the worker failed to run this plan",
            dead_plan=encode(plan),
            failures=failures,
        )

    def _begin_plan(self, entry_id: bytes, plan: StepPlan) -> StepDone | StepOutput | PreparedStep:
        """The epoch and order fences, then the engine's ``begin_step``: a dead letter's
        ``StepDone`` (stale or refused), the output of a step that runs nothing, or
        the step to compute."""
        if plan.epoch < self.epoch:
            # No scheduler waits for it: no output, only the dead letter.
            _log.info("stale_plan_skipped", step_index=plan.step_index, epoch=plan.epoch)
            stale = f"plan of epoch {plan.epoch}, older than the worker's {self.epoch}"
            return StepDone(entry_id, None, dead_error=stale, dead_plan=encode(plan))
        if plan.epoch > self.epoch:
            self._forget_everything(plan.epoch)
        try:
            if plan.step_index <= self._last_step_index:
                raise PlanError(
                    f"step {plan.step_index} comes after step {self._last_step_index}: "
                    "plans must come in the order they were made"
                )
            plan = self._release_stale_admissions(plan)
            begun = self.engine.begin_step(plan)
        except PlanError as error:
            # Refused whole, state unchanged; the empty output tells the scheduler
            # the step ran nothing, so it plans those requests again.
            _log.error("plan_refused", step_index=plan.step_index, error=str(error))
            empty = StepOutput(
                worker_id=self.worker_id, epoch=plan.epoch, step_index=plan.step_index
            )
            return StepDone(entry_id, empty, dead_error=str(error), dead_plan=encode(plan))
        self._last_step_index = plan.step_index
        gateway_ids = self._gateway_ids
        # In the engine's order: releases first, so a request released and
        # admitted again in one plan (a stale admission) keeps its gateway.
        for request_id in plan.released_request_ids:
            gateway_ids.pop(request_id, None)
        for spec in plan.new_requests:
            gateway_ids[spec.request_id] = spec.gateway_id
        return begun

    def _routed(self, entry_id: bytes, plan: StepPlan, output: StepOutput) -> StepDone:
        """The step's ``StepDone``: its tokens and failures by gateway."""
        gateway_ids = self._gateway_ids
        batches: dict[str, list[SampledToken]] = defaultdict(list)
        for token in output.tokens:
            if token.finish_reason is None:
                batches[gateway_ids.get(token.request_id, "")].append(token)
            else:
                batches[gateway_ids.pop(token.request_id, "")].append(token)
        failures = [GatewayFailure(gateway_ids.pop(f.request_id, ""), f) for f in output.failed]
        if failures:
            _log.warning(
                "requests_failed",
                step_index=plan.step_index,
                request_ids=[f.failure.request_id for f in failures],
                errors=[f.failure.message for f in failures],
            )
        self._summarize(output)
        step_gap_s = None
        if output.num_new_tokens:
            step_end_s = time.perf_counter()
            # Wall time between this forward pass and the previous one: the
            # control plane's share (plan wait, bookkeeping outside the forward).
            if self._last_step_end_s is not None:
                step_gap_s = max(0.0, step_end_s - self._last_step_end_s - output.step_ms / 1000)
            self._last_step_end_s = step_end_s
        num_requests = len(plan.prefill_chunks) + len(plan.decode_request_ids)
        return StepDone(
            entry_id,
            output,
            dict(batches),
            num_requests=num_requests,
            step_gap_s=step_gap_s,
            failures=failures,
        )

    def _forget_everything(self, epoch: int) -> None:
        """A new scheduler: drop the old one's requests (their K/V goes back to the pool)."""
        stale_ids = self.engine.active_request_ids
        if stale_ids:
            release = StepPlan(
                worker_id=self.worker_id,
                epoch=epoch,
                step_index=-1,
                released_request_ids=stale_ids,
            )
            self.engine.step(release)
        self._gateway_ids.clear()
        _log.info("new_epoch", epoch=epoch, num_dropped=len(stale_ids))
        self.epoch = epoch
        self._last_step_index = -1

    def _release_stale_admissions(self, plan: StepPlan) -> StepPlan:
        """A plan admits a request only when the scheduler holds no state of it here,
        so state the engine still has for it (a plan of an earlier incarnation of
        this worker id, read before the scheduler saw our join) is stale: drop it."""
        if not plan.new_requests:
            return plan
        active = set(self.engine.active_request_ids)
        released = set(plan.released_request_ids)
        stale_ids = [
            spec.request_id
            for spec in plan.new_requests
            if spec.request_id in active and spec.request_id not in released
        ]
        if not stale_ids:
            return plan
        _log.warning("stale_requests_released", request_ids=stale_ids)
        return msgspec.structs.replace(
            plan, released_request_ids=[*plan.released_request_ids, *stale_ids]
        )

    def _summarize(self, output: StepOutput) -> None:
        """The hot loop's log: one summary line every SUMMARY_EVERY_STEPS steps."""
        if not output.num_new_tokens:
            return
        self._num_steps += 1
        self._window_busy_s += output.step_ms / 1000
        if self._num_steps % SUMMARY_EVERY_STEPS == 0:
            now = time.monotonic()
            wall_s = max(now - self._window_started_s, 1e-9)
            _log.info(
                "worker_summary",
                num_steps=self._num_steps,
                num_tokens=self.engine.stats.num_tokens,
                busy_fraction=round(self._window_busy_s / wall_s, 3),
                num_active_requests=len(self.engine.active_request_ids),
                num_free_blocks=self.engine.num_free_blocks,
            )
            self._window_started_s, self._window_busy_s = now, 0.0
