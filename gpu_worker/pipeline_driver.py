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

The loop keeps the bookkeeping; the stage's own work runs on a thread of its
own (the stage's "device"): each begun step is queued to it, and it passes
the step on, runs this stage's layers and sends the hidden states, while the
loop already begins the next plan and records the answers, as a GPU's host
thread does beside its kernels. Every send to the next stage (and every
collective of this stage's tensor ranks) comes from that one thread, in step
order. Another thread waits for the last stage's answers and hands them to the
loop over a local pipe, so the loop waits on the shell's plans and the answers
at once; either thread's word that a peer is gone comes the same way.
"""

from __future__ import annotations

import queue
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
from gpu_worker.step_path import StepInputs
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
class _Issued:
    """A begun step for the stage's compute thread: its ``StageStep`` encoded (sent
    on before the layers run) and its inputs."""

    payload: bytes
    inputs: StepInputs


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
        self._answers_lock = threading.Lock()  # two threads write to the loop's pipe
        # The stage thread's work: steps, then the stop (None: end at once, a rank is gone).
        self._to_compute: queue.SimpleQueue[_Issued | StageStop | None] = queue.SimpleQueue()
        self.busy = StageBusy(member.link.num_stages)

    def serve(self, connection: Connection, decode_job: Callable[[bytes], PlanJob | None]) -> None:
        """Until the shell's None (or its end): every plan run, every answer sent on;
        then the stages are stopped in order. Raises PipelineBroken where a rank is gone."""
        threads = []
        if not self.member.last:  # the answers come from another stage
            threads = [
                threading.Thread(target=self._listen, name="pipeline-answers", daemon=True),
                threading.Thread(target=self._compute, name="pipeline-stage", daemon=True),
            ]
        for thread in threads:
            thread.start()
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
            if self.member.last:
                self._stop_stages()
            else:
                self._to_compute.put(StageStop())  # down the pipeline after every step
        finally:
            self._to_compute.put(None)
            for thread in threads:
                thread.join(timeout=5)

    def _stop_stages(self) -> None:
        """The ``StageStop`` to this stage's other ranks and the stages behind."""
        link = self.member.link
        stop = encoder.encode(StageStop())
        link.share_message(stop)
        if not self.member.last:
            link.send_message(stop, link.next)
        link.wait_sent()

    def _compute(self) -> None:
        """The stage's thread: each queued step passed on (forward-on-issue), through
        this stage's layers and its hidden states sent, in order; the stop last."""
        link = self.member.link
        try:
            while isinstance(issued := self._to_compute.get(), _Issued):
                began_s = time.perf_counter()
                link.share_message(issued.payload)  # this stage's other tensor ranks
                link.send_message(issued.payload, link.next)
                try:
                    output = self.stage.forward(issued.inputs, None)
                except Exception:  # the step fails (the stages behind are told), the group goes on
                    _log.exception("stage_step_failed", rank=0)
                    output = None
                link.send_hidden(output, [(time.perf_counter() - began_s) * 1000], link.next)
            if issued is not None:
                self._stop_stages()
        except Exception as error:  # a rank is gone
            self._report_broken(error)

    def _listen(self) -> None:
        """The last stage's answers to the loop, until the answer to the stop."""
        link = self.member.link
        try:
            while True:
                payload = link.recv_message(link.last, results=True)
                with self._answers_lock:
                    self._answers_in.send_bytes(payload)
                if STAGE_RESULT.decode(payload).step_id < 0:
                    return
        except Exception as error:  # a rank is gone
            self._report_broken(error)

    def _report_broken(self, error: Exception) -> None:
        _log.error("group_rank_lost_a_peer", rank=0, error=str(error).splitlines()[0])
        with self._answers_lock:
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
        payload = encoder.encode(step)
        if self.member.last:  # one stage: its logits are here
            self._run_here(started, step, payload)
            return
        worked = {work.request.spec.request_id for work in prepared.works}
        in_flight = _InFlight(step.step_id, started, named | worked, time.perf_counter())
        self._in_flight.append(in_flight)
        self._to_compute.put(_Issued(payload, prepared.inputs))

    def _run_here(self, started: StartedPlan, step: StageStep, payload: bytes) -> None:
        """A one-stage group's step: its tensor ranks told, the layers run, sampled."""
        began_s = time.perf_counter()
        self.member.link.share_message(payload)
        samples = None
        try:
            logits = self.stage.forward(step.inputs, None)
            samples = sample_rows(logits, step.sampling_rows)
        except Exception:  # the step fails, the group goes on
            _log.exception("stage_step_failed", rank=0, step_index=started.plan.step_index)
        compute_ms = (time.perf_counter() - began_s) * 1000
        outcome = None
        if samples is not None:
            outcome = StepOutcome(samples, PIPELINE_PATH, [compute_ms])
        self.send(self.runner.finish(started, outcome, compute_ms))
        self.busy.add([compute_ms])
