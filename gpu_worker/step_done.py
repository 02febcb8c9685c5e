"""What the engine side of a worker hands its Redis shell for one plan (msgspec
Structs: they cross from the engine process over a pipe; no torch here)."""

from __future__ import annotations

import msgspec

from shared.messages import RequestFailure, SampledToken, StepOutput


class GatewayFailure(msgspec.Struct, frozen=True):
    """A request that ended with an error in a step, and the gateway to tell."""

    gateway_id: str
    failure: RequestFailure


class EngineCounters(msgspec.Struct, frozen=True):
    """The engine's totals after a step (``EngineStats``), for the worker's metrics."""

    num_steps: int
    num_tokens: int
    busy_s: float


class StepDone(msgspec.Struct, frozen=True, tag="step"):
    """What the publisher sends for one plan entry."""

    entry_id: bytes
    output: StepOutput | None  # None: a skipped plan, only acknowledged
    batches: dict[str, list[SampledToken]] = {}
    dead_error: str | None = None  # why the plan went to the dead letters, if it did
    dead_plan: bytes | None = None  # the plan, encoded, if so
    num_requests: int = 0  # requests in the step's forward pass (its batch size)
    step_gap_s: float | None = None  # time outside forward passes since the previous step
    failures: list[GatewayFailure] = []
    counters: EngineCounters | None = None
