"""Property tests: random traces with tenants, weights, lengths, shared
prompt prefixes, cancels and lost workers, against simulated workers that
check the protocol, their blocks and every cached prefix's tokens
(tests/scheduler_actor/harness.py checks the rest)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import MAX_WORKERS_LOST, WORKERS_LOST_MESSAGE
from tests.scheduler_actor.harness import Job, run

PROPERTY_SETTINGS = settings(
    max_examples=110,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def cluster(draw):
    block_size = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(2, 24))
    return {
        "num_workers": draw(st.integers(1, 3)),
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_inflight": draw(st.integers(1, 3)),
    }


@st.composite
def jobs(draw, capacity_tokens: int, cancels: bool = True):
    num_jobs = draw(st.integers(1, 25))
    result = []
    for _ in range(num_jobs):
        # Some jobs fill the whole K/V of a worker: prompt + max_tokens == capacity.
        total = draw(st.one_of(st.just(capacity_tokens), st.integers(2, capacity_tokens)))
        num_prompt_tokens = draw(st.integers(1, total - 1))
        arrival = draw(st.integers(0, 30))
        cancel = draw(st.none() | st.integers(arrival, arrival + 40)) if cancels else None
        max_tokens = total - num_prompt_tokens
        stop = draw(st.none() | st.integers(0, max_tokens - 1))
        tenant = draw(st.sampled_from(["a", "b", "c"]))
        # Many share a prefix with the tenant's other jobs: the prefix cache is exercised.
        shared = draw(st.one_of(st.just(0), st.integers(0, num_prompt_tokens)))
        result.append(Job(tenant, num_prompt_tokens, max_tokens, arrival, cancel, stop, shared))
    return result


@st.composite
def scenario(draw, policy: PolicyName, with_faults: bool = True):
    spec = draw(cluster())
    capacity = spec["num_blocks"] * spec["block_size"]
    trace = draw(jobs(capacity, cancels=with_faults))
    config = SchedulerConfig(
        policy=policy,
        max_batch_size=draw(st.integers(1, 8)),
        token_budget=draw(st.integers(1, 64)),
        max_chunk_tokens=draw(st.integers(1, 64)),
        w_in=draw(st.sampled_from([0.0, 1.0, 2.0])),
        w_out=draw(st.sampled_from([1.0, 2.0])),
        tenant_weights=draw(
            st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from([0.5, 1.0, 3.0]))
        ),
        overlap=draw(st.booleans()),
        prefix_caching=draw(st.sampled_from([True, True, False])),
        routing_slack=draw(st.integers(0, 3)),
    )
    lost = (
        draw(st.dictionaries(st.integers(0, 80), st.integers(0, 2), max_size=3))
        if with_faults
        else {}
    )
    return config, trace, spec, lost


def _check_outcome(trace, outcome, lost_ticks=None) -> None:
    assert len(outcome.finished) == len(trace), "a request was lost"
    num_losses = len(lost_ticks or {})
    for index, job in enumerate(trace):
        item = outcome.finished[f"r{index}"]
        tokens = item.token_ids
        # Tokens are exactly 0..n-1 in order, across preemptions and lost workers.
        assert tokens == [1000 + i for i in range(len(tokens))]
        if item.finish_reason == "length":
            assert len(tokens) == job.max_tokens
        elif item.finish_reason == "stop":
            assert len(tokens) == job.stop_index + 1
        elif item.finish_reason == "error":
            # Only a request that two lost workers held ends with an error.
            assert item.error == WORKERS_LOST_MESSAGE and num_losses >= MAX_WORKERS_LOST
        else:
            assert job.cancel_tick is not None


@PROPERTY_SETTINGS
@given(scenario(PolicyName.FAIR))
def test_fair_invariants(case) -> None:
    config, trace, spec, lost = case
    _check_outcome(trace, run(config, trace, lost_ticks=lost, **spec), lost)


@PROPERTY_SETTINGS
@given(scenario(PolicyName.ORCA))
def test_orca_invariants(case) -> None:
    config, trace, spec, lost = case
    _check_outcome(trace, run(config, trace, lost_ticks=lost, **spec), lost)


@PROPERTY_SETTINGS
@given(scenario(PolicyName.REQUEST))
def test_request_invariants(case) -> None:
    config, trace, spec, lost = case
    _check_outcome(trace, run(config, trace, lost_ticks=lost, **spec), lost)


@PROPERTY_SETTINGS
@given(scenario(PolicyName.ORCA, with_faults=False))
def test_orca_iteration_level_fcfs_single_worker(case) -> None:
    config, trace, spec, _ = case
    spec = {**spec, "num_workers": 1}
    _check_outcome(trace, run(config, trace, **spec))
