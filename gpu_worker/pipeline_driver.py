"""The first stage of a worker group: the plans of the worker's shell in, down
the pipeline, and each step's ``StepDone`` out once the last stage answers.

The engine's bookkeeping is here alone (``Engine.begin_step``, ``finish_step``:
the requests, their block tables, the tokens sampled); the stages behind run
what they are sent. A step goes down as soon as it has begun, before this
stage's layers run (forward-on-issue), and the next plan may begin while the
step is still in later stages: the scheduler keeps up to one plan per stage in
flight (Orca's Figure 8), each a batch of its own. A plan that names a
request still in flight waits for that step's answer first (its next input
is that step's sample), so plans that overlap stay exact, only slower.

A thread waits for the last stage's answers and hands them to the loop over a
local pipe, so the loop waits on the shell's plans and the answers at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait

import structlog

from gpu_worker.engine import StepOutcome
from gpu_worker.engine_host import PlanJob
from gpu_worker.pipeline_messages import (
    STAGE_RESULT,
    StageResult,
    StageStep,
    StageStop,
    encoder,
)
from gpu_worker.pipeline_stage import PipelineStage
from gpu_worker.plan_runner import SUMMARY_EVERY_STEPS, PlanRunner, StartedPlan
from gpu_worker.sampler import sample_rows
from gpu_worker.step_done import StepDone
from gpu_worker.worker_group import GroupMember
from shared.messages import StepPlan

# The name of a pipeline's steps in metrics and the dashboard.
PIPELINE_PATH = "pipeline"
# A thread's word to the loop that the answers stopped (a peer is gone).
_BROKEN = b""

_log = structlog.get_logger(__name__)


class PipelineBroken(RuntimeError):
    """A rank of the group is gone: the group cannot go on."""


def plan_request_ids(plan: StepPlan) -> set[str]:
    """Every request a plan names (admitted, worked on or released)."""
    return {
        *(spec.request_id for spec in plan.new_requests),
        *(chunk.request_id for chunk in plan.prefill_chunks),
        *plan.decode_request_ids,
        *plan.released_request_ids,
    }


@dataclass(frozen=True)
class _InFlight:
    step_id: int
    started: StartedPlan
    request_ids: set[str]
    sent_s: float


class StageBusy:
    """Each stage's share of the wall time spent computing, logged every
    ``SUMMARY_EVERY_STEPS`` steps (``pipeline_summary``): a stage that waits on
    the others (a bubble) shows below 1."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self._busy_ms = [0.0] * num_stages
        self._num_steps = 0
        self._window_started_s = time.perf_counter()

    def add(self, stage_ms: list[float]) -> None:
        """One step's compute time in each stage (ms)."""
        if len(stage_ms) != self.num_stages:
            return  # a failed step
        self._busy_ms = [total + ms for total, ms in zip(self._busy_ms, stage_ms, strict=True)]
        self._num_steps += 1
        if self._num_steps % SUMMARY_EVERY_STEPS == 0:
            now = time.perf_counter()
            wall_ms = max((now - self._window_started_s) * 1000, 1e-6)
            _log.info(
                "pipeline_summary",
                num_steps=self._num_steps,
                stage_busy_fraction=[round(ms / wall_ms, 3) for ms in self._busy_ms],
            )
            self._busy_ms = [0.0] * self.num_stages
            self._window_started_s = now


class PipelineDriver:
    """Rank 0's loop: plans from the shell (``PlanJob``s, None to end) to StepDones."""

    def __init__(
        self,
        runner: PlanRunner,
        member: GroupMember,
        stage: PipelineStage,
        send: Callable[[StepDone], None],
    ) -> None:
        self.runner = runner
        self.member = member
        self.stage = stage
        self.send = send
        self._in_flight: deque[_InFlight] = deque()
        self._next_step_id = 0
        self._answers, self._answers_in = Pipe(duplex=False)
        self.busy = StageBusy(member.link.num_stages)

    def serve(self, connection: Connection, decode_job: Callable[[bytes], PlanJob | None]) -> None:
        """Until the shell's None (or its end): every plan run, every answer sent on;
        then the stages are stopped in order. Raises PipelineBroken where a rank is gone."""
        link = self.member.link
        listener = None
        if not self.member.last:  # the answers come from another stage
            listener = threading.Thread(target=self._listen, name="pipeline-answers", daemon=True)
            listener.start()
        try:
            while True:
                ready = wait([connection, self._answers])
                if self._answers in ready:
                    self._take_answer()
                    continue
                try:
                    job = decode_job(connection.recv_bytes())
                except EOFError:
                    job = None
                if job is None:
                    break
                self._run(job)
            while self._in_flight:
                self._take_answer()
            stop = encoder.encode(StageStop())
            link.share_message(stop)
            if not self.member.last:
                link.send_message(stop, link.next)
            link.wait_sent()
        finally:
            if listener is not None:
                listener.join(timeout=5)

    def _listen(self) -> None:
        """The last stage's answers to the loop, until the answer to the stop."""
        link = self.member.link
        try:
            while True:
                payload = link.recv_message(link.last, results=True)
                self._answers_in.send_bytes(payload)
                if STAGE_RESULT.decode(payload).step_id < 0:
                    return
        except Exception as error:  # a rank is gone
            _log.error("group_rank_lost_a_peer", rank=0, error=str(error).splitlines()[0])
            self._answers_in.send_bytes(_BROKEN)

    def _take_answer(self) -> None:
        payload = self._answers.recv_bytes()
        if payload == _BROKEN:
            raise PipelineBroken("a rank of the worker group is gone")
        result = STAGE_RESULT.decode(payload)
        if result.step_id < 0:
            return
        self._finish(result)

    def _finish(self, result: StageResult) -> None:
        in_flight = self._in_flight.popleft()
        assert in_flight.step_id == result.step_id, (in_flight.step_id, result.step_id)
        outcome = None
        if result.samples is not None:
            outcome = StepOutcome(result.samples, PIPELINE_PATH, result.stage_ms)
        else:
            _log.error("pipeline_step_failed", step_index=in_flight.started.plan.step_index)
        step_ms = (time.perf_counter() - in_flight.sent_s) * 1000
        self.send(self.runner.finish(in_flight.started, outcome, step_ms))
        self.busy.add(result.stage_ms)

    def _run(self, job: PlanJob) -> None:
        plan = job.plan
        named = plan_request_ids(plan)
        # Its requests' last samples (and blocks) must be back before it begins.
        while any(named & in_flight.request_ids for in_flight in self._in_flight):
            self._take_answer()
        started = self.runner.start(job.entry_id, plan, job.received_at)
        if isinstance(started, StepDone):
            self.send(started)
            return
        prepared = started.prepared
        step = StageStep(self._next_step_id, prepared.inputs, prepared.sampling_rows())
        self._next_step_id += 1
        link = self.member.link
        sent_s = time.perf_counter()
        payload = encoder.encode(step)
        link.share_message(payload)  # this stage's other tensor ranks
        if not self.member.last:
            link.send_message(payload, link.next)  # forward-on-issue
        samples = None
        try:
            output = self.stage.forward(prepared.inputs, None)
            if self.member.last:  # one stage: its logits are here
                samples = sample_rows(output, step.sampling_rows)
        except Exception:  # the step fails (the stages behind are told), the group goes on
            _log.exception("stage_step_failed", rank=0, step_index=plan.step_index)
            output = None
        compute_ms = (time.perf_counter() - sent_s) * 1000
        if self.member.last:
            outcome = None
            if samples is not None:
                outcome = StepOutcome(samples, PIPELINE_PATH, [compute_ms])
            self.send(self.runner.finish(started, outcome, compute_ms))
            self.busy.add([compute_ms])
            return
        link.send_hidden(output, [compute_ms], link.next)
        worked = {work.request.spec.request_id for work in prepared.works}
        self._in_flight.append(_InFlight(step.step_id, started, named | worked, sent_s))
