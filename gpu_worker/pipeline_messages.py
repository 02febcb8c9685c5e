"""What the stages of a worker group say to each other (the control plane).

The first stage sends each step down the pipeline as a ``StageStep`` as soon
as it has begun it (before its own layers run: Orca's forward-on-issue), and
each stage passes it on before computing; the hidden states follow on the
data plane (``pipeline_link.py``). The last stage samples and sends the first
a ``StageResult``. A ``StageStop`` ends every stage, in order.
"""

from __future__ import annotations

import msgspec

from gpu_worker.sampler import SamplingRow
from gpu_worker.step_path import StepInputs


class StageStep(msgspec.Struct, frozen=True, tag="step"):
    """One step for every stage: the flattened tokens (ids, positions, K/V slots,
    each request's layout), and the rows the last stage samples."""

    step_id: int
    inputs: StepInputs
    sampling_rows: list[SamplingRow]


class StageStop(msgspec.Struct, frozen=True, tag="stop"):
    """No more steps: each stage passes it on and ends."""


class StageResult(msgspec.Struct, frozen=True):
    """The last stage's answer to a step: each sampling row's token id or why it
    could not be sampled (None: a stage's forward failed); how long each stage
    computed it (ms, stage by stage). ``step_id`` -1 answers the ``StageStop``."""

    step_id: int
    samples: list[int | str] | None
    stage_ms: list[float] = []


STAGE_MESSAGE = msgspec.msgpack.Decoder(StageStep | StageStop)
STAGE_RESULT = msgspec.msgpack.Decoder(StageResult)
encoder = msgspec.msgpack.Encoder()
