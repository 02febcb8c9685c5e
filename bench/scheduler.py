"""Cost of one ``next_plan`` against the size of the waiting pool and the batch.

    python -m bench.scheduler [--steps 300] [--prompts shared,distinct]

A single worker with room for the whole batch; the pool is kept at its size by
submitting a new request for every one that finishes; the simulated worker
executes each plan (not timed). ``shared`` prompts are all one token
repeated (each tenant's prefix cache finds nearly all of every prompt, so
nearly every request decodes); ``distinct`` ones differ from their first
token (nothing is ever found, every block is cached and evicted in turn).
Prints median and p99 microseconds per call, and per turn of the core for one
step (the result decoded and taken, the next plan made and encoded: what the
scheduler actor does per step besides I/O).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SamplingParams, decode_step_output, encode

BLOCK_SIZE = 16


def measure(
    policy: PolicyName, num_waiting: int, batch_size: int, num_steps: int, distinct: bool = False
) -> tuple[list[float], list[float]]:
    """Microseconds of each timed ``next_plan`` in steady state, and of each
    whole turn of the scheduler's core for one step: the result decoded from
    its bytes and taken (``on_result``), the next plan made and encoded."""
    rng = random.Random(0)
    prompts = {n: [1] * n for n in range(32, 513)}
    config = SchedulerConfig(
        policy=policy, max_batch_size=batch_size, token_budget=max(512, 2 * batch_size)
    )
    scheduler = Scheduler(config, time.monotonic)
    num_blocks = batch_size * (640 // BLOCK_SIZE) * 2
    scheduler.worker_joined("w", num_blocks, BLOCK_SIZE, 1)
    worker = SimulatedWorker("w", num_blocks, BLOCK_SIZE, CostModel())
    next_id = 0

    def submit() -> None:
        nonlocal next_id
        prompt = prompts[rng.randint(32, 512)]
        scheduler.submit(
            str(next_id),
            f"tenant{next_id % 8}",
            [next_id + 2, *prompt[1:]] if distinct else prompt,
            SamplingParams(max_tokens=rng.randint(1, 128)),
        )
        next_id += 1

    for _ in range(num_waiting):
        submit()
    # The pool is long-lived: move it out of the collector's generations, or
    # every full collection walks 100k requests inside some next_plan.
    gc.collect()
    gc.freeze()
    timings_us: list[float] = []
    turns_us: list[float] = []
    warmup = 200
    result: bytes | None = None
    for step in range(warmup + num_steps):
        started = time.perf_counter_ns()
        finished = [] if result is None else scheduler.on_result(decode_step_output(result))
        for _ in finished:
            submit()
        plan_started = time.perf_counter_ns()
        plan = scheduler.next_plan("w")
        plan_ended = time.perf_counter_ns()
        assert plan is not None
        encode(plan)
        ended = time.perf_counter_ns()
        if step >= warmup:
            timings_us.append((plan_ended - plan_started) / 1000)
            # Submits of new requests are not the turn's: they stand for the
            # gateways' submits, which the turn reads anyway.
            turns_us.append((ended - started) / 1000)
        result = encode(worker.execute(plan)[0])
    gc.unfreeze()
    return timings_us, turns_us


def main() -> None:
    """Print the table whose batch-256 turns docs/performance.md quotes ("Control plane")."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--policies", default="fair,orca")
    parser.add_argument("--prompts", default="shared,distinct")
    args = parser.parse_args()
    print(
        "| policy | prompts | waiting | batch | next_plan median µs | p99 µs "
        "| turn median µs | p99 µs |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.policies.split(","):
        for prompts in args.prompts.split(","):
            for num_waiting in (1_000, 10_000, 100_000):
                for batch_size in (32, 256):
                    plans, turns = measure(
                        PolicyName(name), num_waiting, batch_size, args.steps, prompts == "distinct"
                    )
                    print(
                        f"| {name} | {prompts} | {num_waiting:,} | {batch_size} "
                        f"| {_median_p99(plans)} | {_median_p99(turns)} |",
                        flush=True,
                    )


def _median_p99(timings_us: list[float]) -> str:
    ordered = sorted(timings_us)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{statistics.median(ordered):.0f} | {p99:.0f}"


if __name__ == "__main__":
    main()
