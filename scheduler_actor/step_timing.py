"""Where each step's wall time goes, summed for ``bench/control_plane.py``.

Every timed ``StepOutput`` (``shared/messages.py`` ``StepTiming``) adds its
segments when the scheduler reads it; every turn adds the scheduler's own
work and its transaction's round trip. The sums go to their own hash
(``RedisKeys.step_timing``, one field per segment) a few times a second, so a
benchmark reads them before and after a run and divides by ``num_steps`` and
``num_turns``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from redis.asyncio.client import Pipeline

from shared.messages import StepTiming


@dataclass
class StepTimingTotals:
    """Seconds summed since the last flush, per segment of a step's life."""

    plan_transit_s: float = 0.0  # scheduler sent the plan → the worker read it
    plan_queued_s: float = 0.0  # read → the engine thread took it (behind a running step)
    worker_host_s: float = 0.0  # the engine thread's work on it outside the forward pass
    forward_s: float = 0.0  # the forward pass and sampling
    result_transit_s: float = 0.0  # the step ended → the scheduler read its output
    turn_s: float = 0.0  # the scheduler's work in its turns (after the read, before the commit)
    turn_commit_s: float = 0.0  # its turns' transactions
    num_steps: int = 0
    num_turns: int = 0

    def add_step(self, timing: StepTiming, read_at: float) -> None:
        """One output's segments; ``read_at`` is when the scheduler read it."""
        if timing.planned_at > 0:
            self.plan_transit_s += max(0.0, timing.received_at - timing.planned_at)
        self.plan_queued_s += max(0.0, timing.started_at - timing.received_at)
        self.worker_host_s += max(0.0, timing.ended_at - timing.started_at - timing.forward_s)
        self.forward_s += timing.forward_s
        self.result_transit_s += max(0.0, read_at - timing.ended_at)
        self.num_steps += 1

    def add_turn(self, work_s: float, commit_s: float) -> None:
        """One turn of the scheduler."""
        self.turn_s += work_s
        self.turn_commit_s += commit_s
        self.num_turns += 1

    def queue_flush(self, pipe: Pipeline, key: str) -> None:
        """Add the sums to the hash ``key`` (on ``pipe``) and start again from zero."""
        for field in fields(self):
            value = getattr(self, field.name)
            if not value:
                continue
            if isinstance(value, int):
                pipe.hincrby(key, field.name, value)
            else:
                pipe.hincrbyfloat(key, field.name, value)
            setattr(self, field.name, type(value)())
