"""Cost of one ``next_plan`` against the size of the waiting pool and the batch.

    python bench/scheduler.py [--steps 300]

A single worker with room for the whole batch; the pool is kept at its size by
submitting a new request for every one that finishes; the simulated worker
executes each plan (not timed). Prints median and p99 microseconds per call.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_actor.config import PolicyName, SchedulerConfig
from scheduler_actor.core import Scheduler
from scheduler_actor.cost_model import CostModel
from scheduler_actor.sim_worker import SimulatedWorker
from shared.messages import SamplingParams

BLOCK_SIZE = 16


def measure(policy: PolicyName, num_waiting: int, batch_size: int, num_steps: int) -> list[float]:
    """Microseconds of each timed ``next_plan`` in steady state."""
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
        scheduler.submit(
            str(next_id),
            f"tenant{next_id % 8}",
            prompts[rng.randint(32, 512)],
            SamplingParams(max_tokens=rng.randint(1, 128)),
        )
        next_id += 1

    for _ in range(num_waiting):
        submit()
    # The pool is long-lived: move it out of the collector's generations, or
    # every full collection walks 100k requests inside some next_plan.
    gc.collect()
    gc.freeze()
    timings_us = []
    warmup = 200
    for step in range(warmup + num_steps):
        started = time.perf_counter_ns()
        plan = scheduler.next_plan("w")
        elapsed_us = (time.perf_counter_ns() - started) / 1000
        assert plan is not None
        if step >= warmup:
            timings_us.append(elapsed_us)
        for _ in scheduler.on_result(worker.execute(plan)[0]):
            submit()
    gc.unfreeze()
    return timings_us


def main() -> None:
    """Print the table docs/benchmarks.md quotes."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--policies", default="fair,orca")
    args = parser.parse_args()
    print("| policy | waiting | batch | median µs | p99 µs |")
    print("|---|---:|---:|---:|---:|")
    for name in args.policies.split(","):
        for num_waiting in (1_000, 10_000, 100_000):
            for batch_size in (32, 256):
                timings = sorted(measure(PolicyName(name), num_waiting, batch_size, args.steps))
                p99 = timings[min(len(timings) - 1, int(0.99 * len(timings)))]
                print(
                    f"| {name} | {num_waiting:,} | {batch_size} "
                    f"| {statistics.median(timings):.0f} | {p99:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
