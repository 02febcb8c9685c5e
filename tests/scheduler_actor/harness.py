"""A driver for property tests: the scheduler core against simulated workers,
with cancels and lost workers, checking every invariant after every plan."""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.request import FinishedRequest, RequestStatus
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SamplingParams, StepOutput


@dataclass(frozen=True)
class Job:
    """One request of a random trace."""

    tenant: str
    num_prompt_tokens: int
    max_tokens: int
    arrival_tick: int
    cancel_tick: int | None = None
    stop_index: int | None = None
    # Its prompt starts with this many tokens of its tenant's shared prefix.
    num_shared_tokens: int = 0


@dataclass
class Outcome:
    """What a run produced."""

    finished: dict[str, FinishedRequest] = field(default_factory=dict)
    num_ticks: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the workers were told are cached


def prompt_of(
    index: int, num_tokens: int, tenant: str = "", num_shared_tokens: int = 0
) -> list[int]:
    """A recognisable prompt, so a recompute can be checked token by token; its
    first ``num_shared_tokens`` are the same for every job of the tenant."""
    num_shared = min(num_shared_tokens, num_tokens)
    shared = [100_000 + len(tenant) * 1000 + position for position in range(num_shared)]
    return shared + [index * 7 + position for position in range(num_tokens - num_shared)]


def run(
    config: SchedulerConfig,
    jobs: list[Job],
    num_workers: int,
    num_blocks: int,
    block_size: int,
    max_inflight: int,
    lost_ticks: dict[int, int] | None = None,
    max_ticks: int = 50_000,
) -> Outcome:
    """Drive the jobs to the end, asserting the invariants on the way."""
    tick = [0]
    scheduler = Scheduler(config, lambda: float(tick[0]))
    stop_indices = {
        f"r{i}": job.stop_index for i, job in enumerate(jobs) if job.stop_index is not None
    }
    workers: dict[str, SimulatedWorker] = {}
    pending: dict[str, deque[StepOutput]] = {}
    prompts = {
        f"r{i}": prompt_of(i, job.num_prompt_tokens, job.tenant, job.num_shared_tokens)
        for i, job in enumerate(jobs)
    }

    def expected_tokens(request_id: str) -> list[int]:
        # What a request's K/V holds: its prompt, then the generated tokens (1000 + i).
        return prompts[request_id] + [1000 + i for i in range(jobs[int(request_id[1:])].max_tokens)]

    def join(worker_id: str) -> None:
        scheduler.worker_joined(worker_id, num_blocks, block_size, max_inflight)
        workers[worker_id] = SimulatedWorker(
            worker_id, num_blocks, block_size, CostModel(), stop_indices, expected_tokens
        )
        pending[worker_id] = deque()

    for index in range(num_workers):
        join(f"w{index}")
    lost_ticks = lost_ticks or {}
    outcome = Outcome()
    spec_generated: dict[str, int] = {}
    first_cached: dict[str, int] = {}
    by_tick: dict[int, list[int]] = {}
    cancels: dict[int, list[int]] = {}
    for index, job in enumerate(jobs):
        by_tick.setdefault(job.arrival_tick, []).append(index)
        if job.cancel_tick is not None:
            cancels.setdefault(job.cancel_tick, []).append(index)
    num_submitted = 0

    def record(records: list[FinishedRequest]) -> None:
        for item in records:
            assert item.request_id not in outcome.finished, f"{item.request_id} finished twice"
            outcome.finished[item.request_id] = item

    while num_submitted < len(jobs) or scheduler.requests:
        assert tick[0] < max_ticks, f"no progress: {len(scheduler.requests)} requests stuck"
        for index in by_tick.get(tick[0], []):
            job = jobs[index]
            scheduler.submit(
                f"r{index}",
                job.tenant,
                prompts[f"r{index}"],
                SamplingParams(max_tokens=job.max_tokens),
            )
            num_submitted += 1
        for index in cancels.get(tick[0], []):
            record(scheduler.cancel(f"r{index}"))
        if tick[0] in lost_ticks:
            worker_id = f"w{lost_ticks[tick[0]] % num_workers}"
            record(scheduler.worker_lost(worker_id))
            join(worker_id)
        for worker_id, worker in workers.items():
            plan = scheduler.next_plan(worker_id)
            if plan is not None:
                _check_plan(scheduler, config, plan, spec_generated, first_cached, num_blocks)
                output, _ = worker.execute(plan)
                pending[worker_id].append(output)
            queue = pending[worker_id]
            if queue and (plan is None or len(queue) >= max_inflight):
                record(scheduler.on_result(queue.popleft()))
        if config.policy is PolicyName.ORCA and num_workers == 1 and not lost_ticks:
            _check_fcfs(scheduler)
        check_placements(scheduler)
        tick[0] += 1
    check_charges(config, jobs, outcome, scheduler.vtc.snapshot(), first_cached)
    outcome.num_ticks = tick[0]
    outcome.num_cached_tokens = sum(worker.num_cached_tokens for worker in workers.values())
    outcome.num_preemptions = sum(item.num_preemptions for item in outcome.finished.values())
    return outcome


def _check_plan(scheduler, config, plan, spec_generated, first_cached, num_blocks) -> None:
    requests = scheduler.requests
    ids = [chunk.request_id for chunk in plan.prefill_chunks] + plan.decode_request_ids
    assert len(ids) == len(set(ids)), "a request twice in one plan"
    assert len(ids) <= config.max_batch_size
    if config.policy is PolicyName.FAIR:
        assert plan.num_new_tokens <= config.token_budget
    ledger = scheduler.workers[plan.worker_id].ledger
    assert 0 <= ledger.num_used <= num_blocks
    for spec in plan.new_requests:
        request = requests[spec.request_id]
        assert spec.num_generated == len(request.generated_ids)
        assert spec.num_prompt_tokens == len(request.prompt_ids) + spec.num_generated
        assert spec.num_cached_tokens % ledger.block_size == 0
        assert 0 <= spec.num_cached_tokens < spec.num_prompt_tokens
        spec_generated[spec.request_id] = spec.num_generated
        first_cached.setdefault(spec.request_id, spec.num_cached_tokens)
    for chunk in plan.prefill_chunks:
        # A recompute continues from the tokens generated so far (token i is 1000 + i).
        request = requests[chunk.request_id]
        num_generated = spec_generated[chunk.request_id]
        context = request.prompt_ids + [1000 + i for i in range(num_generated)]
        end = chunk.start_position + len(chunk.token_ids)
        assert chunk.token_ids == context[chunk.start_position : end]


def check_charges(
    config: SchedulerConfig,
    jobs: list[Job],
    outcome: Outcome,
    services: Mapping[str, float],
    first_cached: Mapping[str, int],
) -> None:
    """VTC charged each request that ever ran the prompt tokens it computed at
    its first placement exactly once (not the cached ones, and not again when
    preempted or recomputed after a lost worker), and each delivered token once."""
    expected: dict[str, float] = {}
    for index, job in enumerate(jobs):
        request_id = f"r{index}"
        amount = config.w_out * len(outcome.finished[request_id].token_ids)
        if request_id in first_cached:
            num_cached = min(first_cached[request_id], job.num_prompt_tokens)
            amount += config.w_in * (job.num_prompt_tokens - num_cached)
        expected[job.tenant] = expected.get(job.tenant, 0.0) + amount
    assert {t: s for t, s in services.items() if s} == {t: s for t, s in expected.items() if s}


def check_placements(scheduler: Scheduler) -> None:
    """Every record of where the requests are agrees: each request's status and
    worker, the workers' placed maps, held batches and block ledgers, the
    waiting queue and the tenant ledger's counts."""
    placed: dict[str, set[str]] = {worker_id: set() for worker_id in scheduler.workers}
    held = {r.request_id for worker in scheduler.workers.values() for r in worker.held}
    num_waiting: Counter[str] = Counter()
    num_running: Counter[str] = Counter()
    for request in scheduler.requests.values():
        if request.status is RequestStatus.PLACED:
            assert request.worker_id is not None
            placed[request.worker_id].add(request.request_id)
            num_running[request.tenant] += 1
        elif request.status is RequestStatus.WAITING:
            assert request.worker_id is None and request.num_blocks == 0
            assert not request.context_ids and request.num_inflight == 0
            num_waiting[request.tenant] += 1
        else:  # finished, its result held until its batch ends
            assert request.status is RequestStatus.FINISHED and request.request_id in held
            assert request.worker_id is None
    for worker_id, worker in scheduler.workers.items():
        assert set(worker.placed) == placed[worker_id], worker_id
        holders = [*worker.placed.values(), *worker.held]
        held_blocks = {block_id for r in holders for block_id in r.block_ids}
        for r in holders:
            assert len(set(r.block_ids)) == len(r.block_ids), r.request_id
        ledger = worker.ledger
        assert ledger.num_used == len(held_blocks), worker_id
        assert 0 <= ledger.num_evictable <= ledger.num_cached <= ledger.num_blocks
        assert ledger.num_free == ledger.num_blocks - len(held_blocks)
    assert scheduler.num_waiting == num_waiting.total()
    ledger = scheduler.tenants
    assert set(ledger.active()) == set(num_waiting) | set(num_running)
    for tenant in ledger.active():
        assert ledger.num_waiting(tenant) == num_waiting[tenant], tenant
        assert ledger.num_running(tenant) == num_running[tenant], tenant


def _check_fcfs(scheduler: Scheduler) -> None:
    """Orca's iteration-level FCFS: among unfinished requests, an earlier
    arrival has run at least as many iterations as a later one. A request whose
    last step is planned but not yet answered counts as finished."""
    live = sorted(
        (
            r
            for r in scheduler.requests.values()
            if r.status is RequestStatus.WAITING
            or (r.status is RequestStatus.PLACED and (r.wants_prefill() or r.wants_decode()))
        ),
        key=lambda r: r.arrival_seq,
    )
    for earlier, later in itertools.pairwise(live):
        assert earlier.num_iterations >= later.num_iterations, (
            earlier.request_id,
            earlier.num_iterations,
            later.request_id,
            later.num_iterations,
        )
