"""Automatic prefix caching in the scheduler: the block ledger, hits, the
budget, VTC's charge, tenant isolation, eviction shares and routing, against
simulated workers that check every cached prefix's tokens."""

from __future__ import annotations

import pytest

from scheduler_actor.__main__ import parse_settings
from scheduler_actor.actor import scheduler_config
from scheduler_actor.block_ledger import BlockLedger
from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.errors import InvalidRequestError
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SamplingParams, StepPlan, TenantLimits
from tests.scheduler_actor.harness import Job, run

BLOCK_SIZE = 4


class Cluster:
    """A scheduler core and simulated workers that check every cached prefix."""

    def __init__(self, num_blocks: int = 32, num_workers: int = 1, **config) -> None:
        self.scheduler = Scheduler(SchedulerConfig(**config), lambda: 0.0)
        self.prompts: dict[str, list[int]] = {}
        self.workers: dict[str, SimulatedWorker] = {}
        self.plans: list[StepPlan] = []
        for index in range(num_workers):
            worker_id = f"w{index}"
            self.scheduler.worker_joined(worker_id, num_blocks, BLOCK_SIZE, 1)
            self.workers[worker_id] = SimulatedWorker(
                worker_id, num_blocks, BLOCK_SIZE, CostModel(), expected_tokens=self._expected
            )

    def _expected(self, request_id: str) -> list[int]:
        return self.prompts[request_id] + [1000 + i for i in range(1000)]

    def submit(self, request_id, prompt, tenant="t", max_tokens=2, cache_group=None) -> None:
        self.prompts[request_id] = prompt
        limits = TenantLimits(cache_group=cache_group)
        sampling = SamplingParams(max_tokens=max_tokens)
        self.scheduler.submit(request_id, tenant, prompt, sampling, limits=limits)

    def drain(self) -> dict[str, int]:
        """Run every plan until no request is left; each request's cached tokens."""
        cached: dict[str, int] = {}
        while self.scheduler.requests:
            ran = False
            for worker_id, worker in self.workers.items():
                plan = self.scheduler.next_plan(worker_id)
                if plan is None:
                    continue
                ran = True
                self.plans.append(plan)
                for spec in plan.new_requests:
                    cached.setdefault(spec.request_id, spec.num_cached_tokens)
                self.scheduler.on_result(worker.execute(plan)[0])
            assert ran, "no worker had anything to run"
        return cached

    def ledger(self, worker_id: str = "w0") -> BlockLedger:
        return self.scheduler.workers[worker_id].ledger


def _tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_a_repeated_prompt_starts_after_its_cached_blocks() -> None:
    cluster = Cluster()
    cluster.submit("first", _tokens(10, 18))
    assert cluster.drain() == {"first": 0}
    # 18 prompt + 1 fed token: 4 full blocks are cached, 16 tokens.
    assert cluster.ledger().num_cached == 4
    cluster.submit("again", _tokens(10, 18))
    assert cluster.drain() == {"again": 16}
    chunks = [c for p in cluster.plans[-2:] for c in p.prefill_chunks if c.request_id == "again"]
    assert [(c.start_position, len(c.token_ids)) for c in chunks] == [(16, 2)]
    stats = cluster.ledger().stats
    assert (stats.num_queries, stats.num_hits, stats.num_hit_tokens) == (2, 1, 16)


def test_a_multi_turn_history_hits_what_the_previous_turn_generated() -> None:
    cluster = Cluster()
    cluster.submit("turn1", _tokens(10, 9), max_tokens=5)
    cluster.drain()
    # The next turn: the history, the answer (1000, 1001, ...) and a new message.
    history = _tokens(10, 9) + [1000 + i for i in range(5)] + _tokens(50, 6)
    cluster.submit("turn2", history)
    # Positions 0..12 hold K/V (the last answer token was never fed): 3 blocks.
    assert cluster.drain() == {"turn2": 12}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (_tokens(10, 4), 0),  # exactly one block: its last token must be computed
        (_tokens(10, 8), 4),  # exactly the cached two blocks: the second is recomputed
        ([*_tokens(10, 10), 99, 98], 8),  # ends inside the third cached block
        (_tokens(10, 3), 0),  # shorter than a block
        ([7, *_tokens(11, 15)], 0),  # differs in its first token
    ],
)
def test_edges_of_a_hit(prompt: list[int], expected: int) -> None:
    cluster = Cluster()
    cluster.submit("warm", _tokens(10, 12))
    cluster.drain()
    cluster.submit("probe", prompt)
    assert cluster.drain() == {"probe": expected}


def test_tenants_never_hit_each_others_blocks_unless_grouped() -> None:
    cluster = Cluster()
    cluster.submit("a1", _tokens(10, 16), tenant="a")
    cluster.drain()
    cluster.submit("b1", _tokens(10, 16), tenant="b")
    assert cluster.drain() == {"b1": 0}
    # A tenant named like a group is not in it.
    cluster.submit("g-named", _tokens(10, 16), tenant="g")
    cluster.submit("in-g", _tokens(10, 16), tenant="c", cache_group="g")
    assert cluster.drain() == {"g-named": 0, "in-g": 0}
    cluster.submit("also-in-g", _tokens(10, 16), tenant="d", cache_group="g")
    assert cluster.drain() == {"also-in-g": 12}


def test_vtc_charges_only_the_prompt_tokens_computed() -> None:
    cluster = Cluster(w_in=1.0, w_out=2.0)
    vtc = cluster.scheduler.vtc
    cluster.submit("first", _tokens(10, 20), max_tokens=1)
    cluster.drain()
    assert vtc.service("t") == 20 + 2
    cluster.submit("again", _tokens(10, 20), max_tokens=1)
    cluster.drain()
    assert vtc.service("t") == 22 + (20 - 16) + 2
    # Another tenant sending the same prompt is charged for all of it.
    cluster.submit("other", _tokens(10, 20), tenant="u", max_tokens=1)
    cluster.drain()
    assert vtc.service("u") == 22


def test_a_block_shared_by_two_running_requests_counts_once() -> None:
    cluster = Cluster(num_blocks=16)
    cluster.submit("warm", _tokens(10, 17), max_tokens=1)
    cluster.drain()
    ledger = cluster.ledger()
    assert (ledger.num_used, ledger.num_evictable, ledger.num_free) == (0, 4, 16)
    cluster.submit("x", _tokens(10, 17), max_tokens=8)
    cluster.submit("y", _tokens(10, 17), max_tokens=8)
    plan = cluster.scheduler.next_plan("w0")
    assert plan is not None
    assert [spec.num_cached_tokens for spec in plan.new_requests] == [16, 16]
    # 4 shared cached blocks, and one block each for token 16.
    assert (ledger.num_used, ledger.num_evictable) == (6, 0)
    assert plan.block_grants["x"][:4] == plan.block_grants["y"][:4]
    cluster.scheduler.on_result(cluster.workers["w0"].execute(plan)[0])
    cluster.drain()
    assert ledger.num_used == 0


def test_a_cache_full_of_unreferenced_blocks_makes_room_by_eviction() -> None:
    cluster = Cluster(num_blocks=8)
    for index in range(4):
        cluster.submit(f"fill{index}", _tokens(100 * index, 8), max_tokens=1)
        cluster.drain()
    ledger = cluster.ledger()
    assert ledger.num_used == 0 and ledger.num_evictable == 8
    # The whole cache, for a prompt none of it matches.
    cluster.submit("big", _tokens(5000, 31), max_tokens=1)
    assert cluster.drain() == {"big": 0}
    assert ledger.stats.num_evictions == 8
    # The most recently cached prefix went last, but it went too: nothing hits.
    cluster.submit("fill3-again", _tokens(300, 8), max_tokens=1)
    assert cluster.drain() == {"fill3-again": 0}


def test_a_chain_loses_its_tail_before_its_head() -> None:
    cluster = Cluster(num_blocks=8)
    cluster.submit("long", _tokens(10, 24), max_tokens=1)  # 6 blocks cached
    cluster.drain()
    cluster.submit("other", _tokens(500, 9), max_tokens=1)  # needs 3: evicts 1 of long's
    cluster.drain()
    cluster.submit("long-again", _tokens(10, 24), max_tokens=1)
    # Its tail block went; its first five are still found.
    assert cluster.drain() == {"long-again": 20}


def test_a_tenant_churning_prefixes_evicts_its_own_blocks_first() -> None:
    cluster = Cluster(num_blocks=16)
    system_prompt = _tokens(10, 12)
    cluster.submit("victim-warm", [*system_prompt, 1, 2], tenant="victim", max_tokens=1)
    cluster.drain()
    for index in range(30):  # 30 distinct 3-block prefixes: the cache over 5 times
        cluster.submit(
            f"churn{index}", _tokens(1000 + 50 * index, 13), tenant="churn", max_tokens=1
        )
        cluster.drain()
    assert cluster.ledger().stats.num_evictions > 16
    cluster.submit("victim", [*system_prompt, 3, 4], tenant="victim", max_tokens=1)
    assert cluster.drain() == {"victim": 12}


def test_routing_follows_the_longest_cached_prefix_unless_overloaded() -> None:
    cluster = Cluster(num_blocks=64, num_workers=2, routing_slack=1)
    history = _tokens(10, 30)
    cluster.submit("turn1", history, max_tokens=1)
    cluster.drain()
    (home,) = {plan.worker_id for plan in cluster.plans}
    (other,) = set(cluster.workers) - {home}
    # Four branches of the conversation at once, each long enough to stay.
    for index in range(4):
        cluster.submit(f"branch{index}", [*history, 1000, index], max_tokens=40)
    placed_on: dict[str, tuple[str, int]] = {}
    for _ in range(3):
        for worker_id in (home, other):
            plan = cluster.scheduler.next_plan(worker_id)
            if plan is not None:
                for spec in plan.new_requests:
                    placed_on[spec.request_id] = (worker_id, spec.num_cached_tokens)
                cluster.scheduler.on_result(cluster.workers[worker_id].execute(plan)[0])
    # Home takes two, then runs more than one beyond the other (the slack):
    # the third goes to the other worker, uncached. Once it ran, the other
    # caches the prefix too, and has more free blocks: the fourth goes there.
    assert placed_on == {
        "branch0": (home, 28),
        "branch1": (home, 28),
        "branch2": (other, 0),
        "branch3": (other, 28),
    }
    cluster.drain()


def test_caching_off_never_hits() -> None:
    cluster = Cluster(prefix_caching=False)
    cluster.submit("first", _tokens(10, 18))
    cluster.drain()
    cluster.submit("again", _tokens(10, 18))
    assert cluster.drain() == {"again": 0}
    assert cluster.ledger().num_cached == 0 and cluster.ledger().stats.num_queries == 0


@pytest.mark.parametrize("token_id", [2**63, -(2**63) - 1, 10**30])
def test_a_token_id_beyond_64_bits_is_refused(token_id: int) -> None:
    cluster = Cluster()
    with pytest.raises(InvalidRequestError):
        cluster.submit("x", [1, 2, token_id])
    cluster.submit("edge", [2**63 - 1, -(2**63), 0, 5])  # the extremes are fine
    assert cluster.drain() == {"edge": 0}


@pytest.mark.parametrize("policy", list(PolicyName))
def test_shared_prefixes_under_every_policy_with_faults(policy: PolicyName) -> None:
    """Staggered requests sharing their tenants' prefixes, preempted, cancelled,
    on a worker that is lost: every hit holds the right tokens (the simulated
    worker checks), and hits happen."""
    jobs = [
        Job(
            tenant="ab"[index % 2],
            num_prompt_tokens=20 + index % 7,
            max_tokens=3 + index % 5,
            arrival_tick=index * 3,
            cancel_tick=index * 3 + 4 if index % 9 == 4 else None,
            num_shared_tokens=16,
        )
        for index in range(30)
    ]
    config = SchedulerConfig(policy=policy, max_batch_size=4, token_budget=32)
    outcome = run(
        config, jobs, num_workers=2, num_blocks=24, block_size=4, max_inflight=2, lost_ticks={40: 1}
    )
    assert len(outcome.finished) == len(jobs)
    assert outcome.num_cached_tokens >= 10 * 12


def test_a_preempted_request_recomputes_from_its_own_cached_blocks() -> None:
    # Two requests whose decodes outgrow 10 blocks: one is preempted, then
    # placed again after the blocks it had filled (its prompt and answer so far).
    cluster = Cluster(num_blocks=10, max_batch_size=2, token_budget=64)
    cluster.submit("a", _tokens(10, 12), max_tokens=20)
    cluster.submit("b", _tokens(500, 12), max_tokens=20)
    specs = {}
    while cluster.scheduler.requests:
        plan = cluster.scheduler.next_plan("w0")
        assert plan is not None
        for spec in plan.new_requests:
            specs.setdefault(spec.request_id, []).append(spec)
        cluster.scheduler.on_result(cluster.workers["w0"].execute(plan)[0])
    recomputed = [spec for placements in specs.values() for spec in placements[1:]]
    assert recomputed, "nothing was preempted"
    for spec in recomputed:
        # What of its blocks the other's decodes did not evict (its tail went
        # first) is found again: it starts after them.
        assert spec.num_generated > 0 and spec.num_cached_tokens > 0, spec


def test_after_a_lost_worker_the_request_hits_the_other_workers_cache() -> None:
    cluster = Cluster(num_blocks=32, num_workers=2)
    system = _tokens(10, 20)  # five blocks
    # Planned together, before either is cached, the two spread over both
    # workers: both workers cache the system prompt.
    cluster.submit("warm0", [*system, 1, 2], max_tokens=1)
    cluster.submit("warm1", [*system, 5, 6], max_tokens=1)
    plans = [cluster.scheduler.next_plan(worker_id) for worker_id in ("w0", "w1")]
    for plan in plans:
        assert plan is not None and len(plan.new_requests) == 1
        cluster.scheduler.on_result(cluster.workers[plan.worker_id].execute(plan)[0])
    assert not cluster.scheduler.requests
    cluster.submit("victim", [*system, 3, 4], max_tokens=30)
    plan = cluster.scheduler.next_plan("w0") or cluster.scheduler.next_plan("w1")
    assert plan is not None and plan.new_requests[0].num_cached_tokens == 20
    lost, other = plan.worker_id, ({"w0", "w1"} - {plan.worker_id}).pop()
    cluster.scheduler.on_result(cluster.workers[lost].execute(plan)[0])
    cluster.scheduler.worker_lost(lost)
    del cluster.workers[lost]
    recompute = cluster.scheduler.next_plan(other)
    assert recompute is not None
    [spec] = recompute.new_requests
    assert (spec.request_id, spec.num_generated, spec.num_cached_tokens) == ("victim", 1, 20)
    cluster.scheduler.on_result(cluster.workers[other].execute(recompute)[0])
    cluster.drain()


def test_the_scheduler_flags_turn_caching_and_cache_routing_off() -> None:
    defaults = parse_settings([])
    assert (defaults.prefix_caching, defaults.cache_aware_routing, defaults.routing_slack) == (
        True,
        True,
        8,
    )
    settings = parse_settings(["--no-prefix-cache", "--no-cache-routing", "--routing-slack=0"])
    config = scheduler_config(settings, epoch=1)
    assert (config.prefix_caching, config.cache_aware_routing, config.routing_slack) == (
        False,
        False,
        0,
    )


@pytest.mark.parametrize("value", ["-1", "1.5", "many", ""])
def test_a_bad_routing_slack_is_a_usage_error(value: str) -> None:
    with pytest.raises(SystemExit):
        parse_settings([f"--routing-slack={value}"])
