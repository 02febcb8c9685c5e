"""Granting blocks the way the scheduler would, for benchmarks and tests that
drive an engine alone (no scheduler, no prefix cache).

In the service the scheduler grants every block a plan writes; here a plan
gets, for each request that needs more, blocks that no running request's
table holds (after the plan's own releases), lowest first.
"""

from __future__ import annotations

import msgspec

from gpu_worker.engine import Engine
from shared.messages import StepOutput, StepPlan


def grant_free_blocks(engine: Engine, plan: StepPlan) -> StepPlan:
    """``plan`` with every block it still needs granted from unheld blocks;
    raises PlanError as ``Engine.step`` would, and ValueError when too few are unheld."""
    missing = engine.blocks_to_grant(plan)
    if not missing:
        return plan
    free = engine.kv_cache.tables.unreferenced(ignoring=plan.released_request_ids)
    granted_already = {block_id for ids in plan.block_grants.values() for block_id in ids}
    # Blocks past num_blocks are held back for the start's checks (path_compiler.py).
    free = [b for b in free if b < engine.num_blocks and b not in granted_already]
    if sum(missing.values()) > len(free):
        raise ValueError(
            f"plan needs {sum(missing.values())} more K/V blocks but only {len(free)} of "
            f"{engine.num_blocks} are free"
        )
    grants = {request_id: list(ids) for request_id, ids in plan.block_grants.items()}
    position = 0
    for request_id, count in missing.items():
        grants.setdefault(request_id, []).extend(free[position : position + count])
        position += count
    return msgspec.structs.replace(plan, block_grants=grants)


def step_alone(engine: Engine, plan: StepPlan) -> StepOutput:
    """Run ``plan`` on an engine driven without a scheduler, its blocks granted here."""
    return engine.step(grant_free_blocks(engine, plan))
