"""The scheduler's live view (scheduler → gateways, through one Redis key): what
the dashboard shows, from what the scheduler already knows.

The scheduler writes one :class:`LiveSnapshot` a few times a second to
``RedisKeys.live_stats`` (MessagePack, a short TTL, so a stopped scheduler's
view disappears); each gateway reads it only while a dashboard is open and
turns it into what that viewer may see (``gateway/dashboard.py``). Bounded:
at most ``MAX_STEPS_PER_WORKER`` recent iterations per worker, at most
``MAX_TENANTS`` tenants.
"""

from __future__ import annotations

import msgspec

MAX_STEPS_PER_WORKER = 64
MAX_TENANTS = 64
# How often the scheduler writes the snapshot, and how long the key outlives a write.
PUBLISH_INTERVAL_S = 0.25
TTL_MS = 5_000
LIVE_STATS_VERSION = 1


class StepRecord(msgspec.Struct, frozen=True, array_like=True):
    """One iteration of one worker, as planned and as it came back."""

    step_index: int
    num_requests: int  # requests in the batch
    num_prefill_tokens: int  # prompt tokens of the prefill chunks
    num_decode_tokens: int  # one per decoding request
    num_joined: int  # requests admitted with this plan
    num_left: int  # requests released (finished, cancelled, preempted) with this plan
    step_ms: float | None  # the worker's forward time; None until its result is in
    # How the worker ran it (gpu_worker/step_path.py: "eager", "graph[1]", ...);
    # "" until its result is in.
    path: str = ""
    # A worker group's: each pipeline stage's compute time (ms), once its result is in.
    stage_ms: list[float] = []


class WorkerLive(msgspec.Struct, frozen=True):
    worker_id: str
    blocks_used: int
    blocks_cached: int  # held by nobody, kept for their cached prefix (evictable)
    blocks_total: int
    num_running: int
    steps: list[StepRecord]  # oldest first, at most MAX_STEPS_PER_WORKER
    pipeline_depth: int = 1  # a worker group's stages (the dashboard's rows of stages)


class TenantLive(msgspec.Struct, frozen=True):
    tenant: str
    service: float  # the fair policy's virtual token counter (VTC)
    num_waiting: int
    num_running: int


class LiveSnapshot(msgspec.Struct, frozen=True):
    time_ms: int  # wall clock, milliseconds since the epoch
    policy: str
    num_waiting: int
    workers: list[WorkerLive]
    tenants: list[TenantLive]  # at most MAX_TENANTS, most service first
    version: int = LIVE_STATS_VERSION


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LiveSnapshot)


def encode_snapshot(snapshot: LiveSnapshot) -> bytes:
    return _encoder.encode(snapshot)


def decode_snapshot(data: bytes) -> LiveSnapshot:
    """Raises ``msgspec.DecodeError``/``ValidationError`` for anything else."""
    return _decoder.decode(data)
