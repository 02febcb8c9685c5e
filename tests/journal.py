"""Writing step-journal entries as a worker would (``shared/request_log.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio.client import Pipeline

from shared.keys import RedisKeys
from shared.messages import SampledToken, StepOutput
from shared.redis_streams import xadd_message


def queue_journal_entry(
    pipe: Pipeline,
    keys: RedisKeys,
    worker_id: str,
    tokens: Sequence[SampledToken],
    step_index: int = -1,
    epoch: int = 0,
) -> None:
    """One step's output carrying ``tokens`` on the journal (the results stream)."""
    output = StepOutput(
        worker_id=worker_id,
        epoch=epoch,
        step_index=step_index,
        tokens=list(tokens),
        num_new_tokens=len(tokens),
    )
    xadd_message(pipe, keys.results, output)
