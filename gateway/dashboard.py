"""What one viewer of ``/dashboard`` sees of the scheduler's live view. Pure.

The scheduler publishes one :class:`shared.live_stats.LiveSnapshot` for
everyone; each viewer gets it as JSON with the other tenants' names replaced
by pseudonyms, unless the viewer's tenant is an operator
(``operator = true`` in its record). A pseudonym is stable for the life of
the gateway (a keyed hash of the name), so a chart over time follows one
tenant, and says nothing about the name.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec

from shared.live_stats import LiveSnapshot

UNAVAILABLE_MESSAGE = "no scheduler is publishing its live view (is one running?)"


class StepView(msgspec.Struct, frozen=True):
    step_index: int
    num_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_joined: int
    num_left: int
    step_ms: float | None
    path: str  # how the worker ran it ("eager", "graph[1]", ...; "" while running)
    stage_ms: list[float]  # a worker group's: each stage's compute time (ms)


class WorkerView(msgspec.Struct, frozen=True):
    worker_id: str
    blocks_used: int
    blocks_cached: int
    blocks_total: int
    num_running: int
    steps: list[StepView]
    pipeline_depth: int  # stages of a worker group (1: one engine)


class TenantView(msgspec.Struct, frozen=True):
    tenant: str
    you: bool
    service: float
    num_waiting: int
    num_running: int


class SnapshotFrame(msgspec.Struct, frozen=True, tag="snapshot", tag_field="type"):
    time_ms: int
    policy: str
    operator: bool
    num_waiting: int
    workers: list[WorkerView]
    tenants: list[TenantView]


class UnavailableFrame(msgspec.Struct, frozen=True, tag="unavailable", tag_field="type"):
    message: str


_encoder = msgspec.json.Encoder()


class Pseudonyms:
    """``tenant 3f9a2c``: the same for one name all the gateway's life."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(16)

    def of(self, name: str) -> str:
        digest = hmac.new(self._secret, name.encode(), hashlib.sha256).hexdigest()
        return f"tenant {digest[:6]}"


def view_frame(
    snapshot: LiveSnapshot, viewer: str, operator: bool, pseudonyms: Pseudonyms
) -> bytes:
    """The JSON text frame of ``snapshot`` for a viewer of tenant ``viewer``."""
    workers = [
        WorkerView(
            worker_id=worker.worker_id,
            blocks_used=worker.blocks_used,
            blocks_cached=worker.blocks_cached,
            blocks_total=worker.blocks_total,
            num_running=worker.num_running,
            steps=[
                StepView(
                    step.step_index,
                    step.num_requests,
                    step.num_prefill_tokens,
                    step.num_decode_tokens,
                    step.num_joined,
                    step.num_left,
                    step.step_ms,
                    step.path,
                    step.stage_ms,
                )
                for step in worker.steps
            ],
            pipeline_depth=worker.pipeline_depth,
        )
        for worker in snapshot.workers
    ]
    tenants = [
        TenantView(
            tenant=tenant.tenant
            if operator or tenant.tenant == viewer
            else pseudonyms.of(tenant.tenant),
            you=tenant.tenant == viewer,
            service=tenant.service,
            num_waiting=tenant.num_waiting,
            num_running=tenant.num_running,
        )
        for tenant in snapshot.tenants
    ]
    frame = SnapshotFrame(
        time_ms=snapshot.time_ms,
        policy=snapshot.policy,
        operator=operator,
        num_waiting=snapshot.num_waiting,
        workers=workers,
        tenants=tenants,
    )
    return _encoder.encode(frame)


def unavailable_frame(message: str = UNAVAILABLE_MESSAGE) -> bytes:
    return _encoder.encode(UnavailableFrame(message))
