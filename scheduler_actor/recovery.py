"""What a new incarnation of the scheduler takes back from Redis when it starts.

A new epoch (workers drop the state of older plans), then every submit an
earlier incarnation left pending, resubmitted with the tokens its request's
log and the journal say were sent (the worker recomputes prompt + those tokens, so a client
sees each token once). See docs/architecture.md (Durability).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from scheduler_actor.event_handler import EventHandler, queue_ack
from shared.keys import SCHEDULER_GROUP, RedisKeys
from shared.messages import SubmitRequest, decode_control_message, decode_step_output
from shared.redis_streams import read_pending
from shared.request_log import read_request_logs


async def take_epoch(redis: aioredis.Redis, keys: RedisKeys, last_epoch: int) -> int:
    """The next epoch: INCR of the epoch key, never at or below ``last_epoch``
    (the last one this process knew)."""
    epoch = int(await redis.incr(keys.epoch))
    if epoch <= last_epoch:
        # Redis came back without the counter: stay above the fenced epochs.
        epoch = last_epoch + 1
        await redis.set(keys.epoch, epoch)
    return epoch


async def recover(
    redis: aioredis.Redis, keys: RedisKeys, consumer: str, handler: EventHandler
) -> int:
    """Take back what an earlier incarnation read and did not finish: every
    pending request (with the tokens its log and the journal say were sent), pending
    cancels and joins; its pending results are stale (their tokens are
    folded from the journal with the logs). Returns the number of requests recovered."""
    dead = keys.dead
    pipe = redis.pipeline(transaction=True)
    pending = await read_pending(
        redis, SCHEDULER_GROUP, consumer, keys.requests, decode_control_message, dead
    )
    submits: list[tuple[bytes, SubmitRequest]] = []
    for entry in pending:
        if isinstance(entry.message, SubmitRequest):
            submits.append((entry.entry_id, entry.message))
        else:
            queue_ack(pipe, keys, keys.requests, entry.entry_id)
    logs = await read_request_logs(redis, keys, [m.request_id for _, m in submits])
    for (entry_id, message), log in zip(submits, logs, strict=True):
        if log is not None:
            handler.checkpoint_recovered(log, pipe)
        if log is not None and log.is_finished:
            queue_ack(pipe, keys, keys.requests, entry_id)
        else:
            generated_ids = [] if log is None else log.token_ids
            handler.submit(entry_id, message, pipe, generated_ids=generated_ids)
    for entry in await read_pending(
        redis, SCHEDULER_GROUP, consumer, keys.control, decode_control_message, dead
    ):
        await handler.apply(entry, pipe)
        queue_ack(pipe, keys, keys.control, entry.entry_id)
    for result in await read_pending(
        redis, SCHEDULER_GROUP, consumer, keys.results, decode_step_output, dead
    ):
        queue_ack(pipe, keys, keys.results, result.entry_id)
    if len(pipe):
        await pipe.execute()
    return handler.num_live_submits
