"""Discrete-event simulation: the scheduler core driving simulated workers.

Pure and deterministic: the trace comes from a seeded generator, step times
from a CostModel, and the scheduler's clock is the simulation's clock. Plans
are issued as soon as a worker has room (``max_inflight``), so with overlap
plan k+1 waits on the worker while plan k runs. Admission is the core's, as
in the service: a submit beyond ``config.max_waiting``, or beyond a tenant's
``max_queued`` (``tenant_limits``), is refused and recorded.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler_actor.config import SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.errors import QueueFullError
from scheduler_actor.request import FinishedRequest
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SamplingParams, StepOutput, StepPlan, TenantLimits


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    request_id: str
    tenant: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int


def orca_trace(
    num_requests: int, rate_per_s: float, seed: int, tenant: str = "default"
) -> list[TraceRequest]:
    """Orca §6: prompt ~ U(32, 512), max_tokens ~ U(1, 128), Poisson arrivals."""
    rng = random.Random(seed)
    arrival_s = 0.0
    trace = []
    for index in range(num_requests):
        arrival_s += rng.expovariate(rate_per_s)
        trace.append(
            TraceRequest(
                f"{tenant}-{index}", tenant, arrival_s, rng.randint(32, 512), rng.randint(1, 128)
            )
        )
    return trace


@dataclass(frozen=True)
class ClusterSpec:
    """The simulated workers (all alike)."""

    num_workers: int = 1
    num_blocks: int = 1024
    block_size: int = 16
    max_inflight: int = 2
    cost_model: CostModel = field(default_factory=CostModel)


@dataclass
class SimulationResult:
    """Everything a run produced."""

    finished: list[FinishedRequest]
    busy_s: float
    end_s: float
    service_samples: list[tuple[float, dict[str, float]]]
    # Requests the core refused at submit (QueueFullError), in arrival order.
    refused_ids: list[str] = field(default_factory=list)


def run_simulation(
    config: SchedulerConfig,
    trace: list[TraceRequest],
    cluster: ClusterSpec,
    sample_every_s: float = math.inf,
    tenant_limits: Mapping[str, TenantLimits] | None = None,
) -> SimulationResult:
    """Run ``trace`` until every request finished or was refused; EOS is
    ignored, so every request generates exactly its max_tokens. Each submit
    carries its tenant's ``tenant_limits``, as the gateways' do."""
    tenant_limits = tenant_limits or {}
    now = [0.0]
    scheduler = Scheduler(config, lambda: now[0])
    workers: dict[str, SimulatedWorker] = {}
    queues: dict[str, deque[StepPlan]] = {}
    running: dict[str, tuple[float, StepOutput]] = {}
    for index in range(cluster.num_workers):
        worker_id = f"w{index}"
        scheduler.worker_joined(
            worker_id, cluster.num_blocks, cluster.block_size, cluster.max_inflight
        )
        workers[worker_id] = SimulatedWorker(
            worker_id, cluster.num_blocks, cluster.block_size, cluster.cost_model
        )
        queues[worker_id] = deque()
    prompts: dict[int, list[int]] = {}
    finished: list[FinishedRequest] = []
    refused_ids: list[str] = []
    samples: list[tuple[float, dict[str, float]]] = []
    next_sample_s = 0.0
    busy_s = 0.0
    next_arrival = 0
    while len(finished) + len(refused_ids) < len(trace):
        for worker_id, worker in workers.items():
            queue = queues[worker_id]
            while (plan := scheduler.next_plan(worker_id)) is not None:
                queue.append(plan)
            if worker_id not in running and queue:
                output, step_s = worker.execute(queue.popleft())
                running[worker_id] = (now[0] + step_s, output)
                busy_s += step_s
        arrival_s = trace[next_arrival].arrival_s if next_arrival < len(trace) else math.inf
        done_id = min(running, key=lambda worker_id: running[worker_id][0], default=None)
        done_s = running[done_id][0] if done_id is not None else math.inf
        if math.isinf(arrival_s) and math.isinf(done_s):
            raise RuntimeError("simulation stalled: nothing runs and nothing arrives")
        if arrival_s <= done_s:
            now[0] = arrival_s
            item = trace[next_arrival]
            next_arrival += 1
            prompt = prompts.setdefault(item.num_prompt_tokens, [1] * item.num_prompt_tokens)
            try:
                scheduler.submit(
                    item.request_id,
                    item.tenant,
                    prompt,
                    SamplingParams(max_tokens=item.max_tokens, ignore_eos=True),
                    limits=tenant_limits.get(item.tenant),
                )
            except QueueFullError:
                refused_ids.append(item.request_id)
        else:
            assert done_id is not None
            now[0] = done_s
            _, output = running.pop(done_id)
            finished += scheduler.on_result(output)
        while now[0] >= next_sample_s:
            samples.append((next_sample_s, dict(scheduler.vtc.snapshot())))
            next_sample_s += sample_every_s
    return SimulationResult(finished, busy_s, now[0], samples, refused_ids)


def summarize(result: SimulationResult) -> dict[str, float]:
    """Throughput, normalized latency (end-to-end / generated tokens), busy
    fraction and requests refused of one run."""
    finished = result.finished
    start_s = min(record.arrival_s for record in finished)
    span_s = max(record.finish_s for record in finished) - start_s
    normalized = sorted(
        (record.finish_s - record.arrival_s) / len(record.token_ids) for record in finished
    )
    num_tokens = sum(len(record.token_ids) for record in finished)
    return {
        "throughput_rps": len(finished) / span_s,
        "throughput_tps": num_tokens / span_s,
        "latency_p50_s_per_token": statistics.median(normalized),
        "latency_p99_s_per_token": normalized[
            min(len(normalized) - 1, int(0.99 * len(normalized)))
        ],
        "busy_fraction": result.busy_s / span_s,
        "num_refused": len(result.refused_ids),
    }
