"""The gateway and the durable request log: a request's log is started with its
submit, a cancel is recorded in it, and tokens that pub/sub lost while the
gateway was cut off from Redis are read back from it."""

from __future__ import annotations

from websockets.asyncio.client import connect

from gateway.server import GatewayServer
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.messages import (
    RequestAdopted,
    RequestEnded,
    RequestRecord,
    SubmitRequest,
)
from shared.protocol import Done, Token
from shared.request_log import queue_record, read_request_log
from tests.conftest import RedisServer
from tests.gateway.test_server import (
    GATEWAY_ID,
    KEYS,
    FakeUpstream,
    accept,
    receive,
    receive_until_done,
    run_with_gateway,
    send,
)
from tests.gateway.worker_tokens import worker_tokens
from tests.journal import queue_journal_entry


def test_the_log_starts_with_the_submit_and_records_a_cancel(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            request_id = await accept(socket, "a", max_tokens=9, stop=["zzz"])
            submit = await upstream.next_submit()
            log = await read_request_log(upstream.redis, KEYS, request_id)
            assert log is not None and log.record.submit == submit
            assert log.record.client_id == "a" and log.record.stop == ["zzz"]
            tokens = worker_tokens(chat_tokenizer, request_id, "one two three", finish=None)
            await upstream.publish(tokens[0])
            assert isinstance(await receive(socket), Token)
            await send(socket, type="cancel", id="a")
            done = await receive(socket)
            assert isinstance(done, Done) and done.finish_reason == "cancelled"
            await upstream.next_cancel()
            log = await read_request_log(upstream.redis, KEYS, request_id)
            # The client got one token; no worker wrote a journal here, so the log
            # knows how far the client got, not the token.
            assert log is not None and log.ended_after == 1 and log.token_ids == []
            assert 0 < await upstream.redis.ttl(KEYS.request_log(request_id)) <= 600

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_tokens_pub_sub_lost_are_read_back_from_the_journal(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            request_id = await accept(socket, "a", max_tokens=9)
            await upstream.next_submit()
            tokens = worker_tokens(chat_tokenizer, request_id, "one two three four")
            # A worker journals every token and publishes it; the first arrives...
            pipe = upstream.redis.pipeline(transaction=True)
            for token in tokens:
                queue_journal_entry(pipe, KEYS, "w0", [token])
            await pipe.execute()
            await upstream.publish(tokens[0])
            assert isinstance(await receive(socket), Token)
            # ... the rest was published while the gateway's pub/sub connection
            # was down (never, here); then that connection drops.
            await upstream.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            rest, done = await receive_until_done(socket)
            assert [t.seq for t in rest] == list(range(1, len(tokens)))
            assert done.finish_reason == "length"
            assert done.usage.completion_tokens == len(tokens)

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_a_request_ended_elsewhere_ends_here_too(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    """A resumed request followed through its log stops when its log says it ended."""

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as first:
            request_id = await accept(first, "a", max_tokens=9)
            await upstream.next_submit()
        # The socket closed: the gateway cancelled the request and logged the end.
        await upstream.next_cancel()
        log = await read_request_log(upstream.redis, KEYS, request_id)
        assert log is not None and log.ended_after == 0
        assert isinstance(log.as_entries()[-1], RequestEnded)
        async with connect(server.url) as second:
            await send(second, type="resume", request_id=request_id)
            done = await receive(second)
            assert isinstance(done, Done) and done.finish_reason == "cancelled"

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)


def test_resume_of_a_request_only_another_gateway_knew_reads_its_log(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with connect(server.url) as socket:
            await accept(socket, "a", max_tokens=9)
            submit = await upstream.next_submit()
        await upstream.next_cancel()
        # Another gateway accepted "r-elsewhere": its record is in the log, its
        # first tokens in the journal.
        other = RequestRecord(
            submit=SubmitRequest(
                request_id="r-elsewhere",
                gateway_id="gw-dead",
                tenant=submit.tenant,
                prompt_ids=submit.prompt_ids,
                sampling=submit.sampling,
            ),
            client_id="x",
        )
        tokens = worker_tokens(chat_tokenizer, "r-elsewhere", "alpha beta gamma delta")
        pipe = upstream.redis.pipeline(transaction=True)
        queue_record(pipe, KEYS, other)
        for token in tokens[:2]:
            queue_journal_entry(pipe, KEYS, "w0", [token])
        await pipe.execute()
        async with connect(server.url) as socket:
            await send(socket, type="resume", request_id="r-elsewhere", after_seq=0)
            first = await receive(socket)
            assert isinstance(first, Token) and first.seq == 1 and first.id == "x"
            # The scheduler learns the request has a live gateway again (no orphan).
            adopted = await upstream.next_control()
            assert adopted == RequestAdopted("r-elsewhere", GATEWAY_ID)
            # The rest arrives while the gateway follows the log and the journal.
            pipe = upstream.redis.pipeline(transaction=True)
            for token in tokens[2:]:
                queue_journal_entry(pipe, KEYS, "w0", [token])
            await pipe.execute()
            rest, done = await receive_until_done(socket)
            assert [t.seq for t in rest] == list(range(2, len(tokens)))
            assert done.finish_reason == "length"

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)
