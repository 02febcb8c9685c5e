"""Every Redis key, stream and channel name, in one place.

All names start with a configurable prefix (default ``orcapod``), so several
deployments can share one Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every stream entry holds one field: the MessagePack bytes of a shared.messages Struct.
MESSAGE_FIELD = "m"
SCHEDULER_GROUP = "scheduler"
WORKER_GROUP = "worker"


@dataclass(frozen=True)
class RedisKeys:
    """Names under one prefix."""

    prefix: str = "orcapod"

    @property
    def requests(self) -> str:
        """Stream: SubmitRequest from gateways."""
        return f"{self.prefix}:requests"

    @property
    def control(self) -> str:
        """Stream: CancelRequest, WorkerJoined, WorkerLeft."""
        return f"{self.prefix}:control"

    @property
    def results(self) -> str:
        """Stream: StepOutput from workers to the scheduler."""
        return f"{self.prefix}:results"

    @property
    def dead(self) -> str:
        """Stream: undecodable messages, with where they came from."""
        return f"{self.prefix}:dead"

    @property
    def epoch(self) -> str:
        """Counter: INCR by each scheduler incarnation; plans carry it (fencing)."""
        return f"{self.prefix}:epoch"

    @property
    def ready(self) -> str:
        """Key with a TTL: set by the scheduler while at least one worker is registered."""
        return f"{self.prefix}:ready"

    @property
    def stats(self) -> str:
        """Hash: service counters (steps, busy time, ...) written by workers."""
        return f"{self.prefix}:stats"

    @property
    def prefix_cache(self) -> str:
        """Hash of the prefix cache's counters, all workers together (fields of
        scheduler_actor/block_ledger.py ``PrefixCacheStats``), for the benchmarks."""
        return f"{self.prefix}:prefix_cache"

    @property
    def step_timing(self) -> str:
        """Hash: where the steps' time went, summed by the scheduler
        (scheduler_actor/step_timing.py), for bench/control_plane.py."""
        return f"{self.prefix}:step_timing"

    @property
    def live_stats(self) -> str:
        """Key with a TTL: the scheduler's live view (shared/live_stats.py), for the dashboard."""
        return f"{self.prefix}:live"

    @property
    def tenants(self) -> str:
        """Hash: sha256 hex of an API key -> MessagePack Tenant (gateway/tenants.py)."""
        return f"{self.prefix}:tenants"

    def tenant_tokens(self, tenant: str, window_index: int) -> str:
        """Counter with a TTL: tokens a tenant reserved in one 60-s window, all gateways."""
        return f"{self.prefix}:tpm:{tenant}:{window_index}"

    def plans(self, worker_id: str) -> str:
        """Stream: the StepPlans of one worker, in order."""
        return f"{self.prefix}:plans:{worker_id}"

    def request_log(self, request_id: str) -> str:
        """Stream: one request's RequestRecord, the tokens sent for it, maybe its end
        (durable: resume on any gateway, recovery by a new scheduler)."""
        return f"{self.prefix}:log:{request_id}"

    def tokens(self, gateway_id: str) -> str:
        """Pub/sub channel: TokenBatch and RequestRejected for one gateway."""
        return f"{self.prefix}:tokens:{gateway_id}"

    def worker_heartbeat(self, worker_id: str) -> str:
        """Key with a TTL, refreshed while the worker lives."""
        return f"{self.prefix}:worker:{worker_id}"

    def gateway_heartbeat(self, gateway_id: str) -> str:
        """Key with a TTL, refreshed while the gateway lives."""
        return f"{self.prefix}:gateway:{gateway_id}"
