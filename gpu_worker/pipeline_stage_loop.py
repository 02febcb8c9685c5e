"""The ranks of a worker group but rank 0: each step as the first stage sent
it, passed on at once by each stage's leader (forward-on-issue) and shared with
the stage's other tensor ranks, then the stage's layers over the hidden states
the stage before sent (or the token ids, in the first stage); the last stage's
leader samples and answers rank 0. Nothing here talks to Redis.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass

import structlog
import torch

from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.pipeline_messages import (
    STAGE_MESSAGE,
    StageResult,
    StageStep,
    StageStop,
    encoder,
)
from gpu_worker.pipeline_stage import PipelineStage
from gpu_worker.sampler import sample_rows
from gpu_worker.worker_group import GroupMember, GroupStartError, join_group
from shared.parent_death import die_with_parent
from shared.settings import WorkerSettings

_log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StagePass:
    """One step through a rank's stage: the output (the hidden states for the next
    stage, the last stage's logits; None where a forward failed, here or before),
    each earlier stage's compute time (ms) and when this one's began."""

    output: torch.Tensor | None
    stage_ms: list[float]
    started_s: float


def pass_through_stage(member: GroupMember, stage: PipelineStage, step: StageStep) -> StagePass:
    """``step`` through this rank's stage: the hidden states from the stage before
    (its leader receives them and shares them with the stage's tensor ranks), the
    stage's layers, and, from a leader but the last stage's, the result sent on. A
    forward that raises is logged and fails the step alone."""
    link, model = member.link, member.model
    num_tokens, hidden_size = len(step.inputs.token_ids), model.config.hidden_size
    stage_ms: list[float] = []
    carried = None
    if not member.first:
        if link.is_leader:
            carried, stage_ms = link.recv_hidden(
                link.previous, num_tokens, hidden_size, model.dtype
            )
        carried = link.share_hidden(carried, num_tokens, hidden_size, model.dtype)
    started_s = time.perf_counter()
    output = None
    if member.first or carried is not None:
        try:
            output = stage.forward(step.inputs, carried)
        except Exception:  # the step fails, the stage goes on
            _log.exception("stage_step_failed", rank=member.rank, step_id=step.step_id)
    if link.is_leader and not member.last:
        stage_ms = [*stage_ms, (time.perf_counter() - started_s) * 1000]
        link.send_hidden(output, stage_ms, link.next)
    return StagePass(output, stage_ms, started_s)


def serve_stage(member: GroupMember, backend_name: str) -> None:
    """Run steps until the first stage's ``StageStop`` (raises where a peer is gone)."""
    model = member.model
    kv_size = member.kv_size
    kv_cache = PagedKVCache(
        model.config, kv_size.num_blocks, kv_size.block_size, model.device, model.dtype
    )
    link = member.link
    samples_here = member.last and link.is_leader
    stage = PipelineStage(model, kv_cache, backend_name, first=member.first, last=samples_here)
    while True:
        payload = None
        if link.is_leader:
            payload = link.recv_message(link.previous)
            if not member.last:
                # The next stage has the plan before this one's compute ends.
                link.send_message(payload, link.next)
        payload = link.share_message(payload)
        message = STAGE_MESSAGE.decode(payload)
        if isinstance(message, StageStop):
            if samples_here:
                link.send_message(encoder.encode(StageResult(-1, None)), 0, results=True)
            link.wait_sent()
            return
        passed = pass_through_stage(member, stage, message)
        if not samples_here:
            continue  # sent on by the leader, or the leader's to send
        samples = None
        if passed.output is not None:
            try:
                samples = sample_rows(passed.output, message.sampling_rows)
            except Exception:
                _log.exception("stage_step_failed", rank=member.rank, step_id=message.step_id)
        # Sampling is the last stage's work too.
        stage_ms = [*passed.stage_ms, (time.perf_counter() - passed.started_s) * 1000]
        result = StageResult(message.step_id, samples, stage_ms)
        link.send_message(encoder.encode(result), 0, results=True)


def stage_process_main(settings: WorkerSettings, rank: int, spawned: bool = True) -> int:
    """A rank behind the first: join the group, serve its steps; the exit status
    (0 after the first stage's stop). ``spawned``: a child of this host's worker
    shell, which decides when it stops (else a process of its own, ended by
    SIGTERM like any)."""
    from gpu_worker.attention import default_backend_name
    from shared.log import configure_logging

    if spawned:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging("worker")
    try:
        member = join_group(settings, rank)
    except GroupStartError as error:
        _log.error("group_failed_to_start", rank=rank, error=str(error))
        if not spawned:
            print(f"python -m gpu_worker: {error}", file=sys.stderr)
        return 1
    backend_name = settings.attention_backend or default_backend_name(member.model.device)
    try:
        serve_stage(member, backend_name)
    except Exception as error:  # a peer is gone (gloo's wait broke): the group is lost
        _log.error("group_rank_lost_a_peer", rank=rank, error=str(error).splitlines()[0])
        return 1
    _log.info("group_rank_stopped", rank=rank)
    return 0
