"""``orcapod bench capacity``: what one gateway holds and fans out, engine aside.

Starts a private redis-server and one gateway (no scheduler, no worker), then:

1. opens ``--sockets`` websockets to it (loopback only, at most 5,000), holds
   them ``--hold-s`` seconds, and pings every one: all must answer;
2. sends one request on each socket and plays the worker itself: it reads the
   requests from the stream and publishes one TokenBatch per "step" holding
   one token for every request, at most two steps ahead of what the clients
   have received, for ``--tokens`` steps. The gateway detokenizes and routes
   every token to its socket; tokens/s counts what the clients received.

CPU (user + system time / wall time) and resident memory are read from the
gateway's /proc entry. The clients and the fake worker run in this process,
on the same cores: on a 2-core machine the gateway gets at most what is left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from orcapod.bench.run import machine
from orcapod.bench.service import benchmark_redis, one_gateway
from shared.keys import MESSAGE_FIELD, RedisKeys
from shared.messages import SampledToken, SubmitRequest, TokenBatch, decode_control_message, encode
from shared.protocol import Done, Error, Generate, Token, decode_server_message, encode_json

MAX_SOCKETS = 5_000
OPEN_CONCURRENCY = 50
STEPS_AHEAD = 2
TOKEN_IDS = (1_000, 2_000, 3_000, 4_000, 5_000, 6_000, 7_000, 8_000)
PHASE_TIMEOUT_S = 120.0
# Requests are sent in waves: a burst of 1,000 submits at once exhausts the
# gateway's Redis connection pool ("Too many connections"; see
# docs/history/benchmarks-notebook.md, "Live service").
SEND_WAVE, SEND_WAVE_PAUSE_S = 20, 0.1


@dataclass
class ProcessSample:
    """CPU seconds used so far and resident memory of one process."""

    cpu_s: float
    rss_mib: float

    @classmethod
    def of(cls, pid: int) -> ProcessSample:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu_s = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        rss_kib = next(
            int(line.split()[1])
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
        return cls(cpu_s, rss_kib / 1024)


def _cpu_share(before: ProcessSample, after: ProcessSample, wall_s: float) -> float:
    return (after.cpu_s - before.cpu_s) / wall_s if wall_s > 0 else 0.0


class Clients:
    """Many sockets, each with a reader counting the tokens it receives."""

    def __init__(self) -> None:
        self.sockets: list[ClientConnection] = []
        self.num_tokens = 0
        self.num_done = 0
        self.num_errors = 0
        self.progress = asyncio.Event()

    async def open(self, url: str, count: int, tasks: asyncio.TaskGroup) -> None:
        limit = asyncio.Semaphore(OPEN_CONCURRENCY)

        async def open_one() -> None:
            async with limit:
                socket = await connect(url, open_timeout=60, max_queue=None)
            self.sockets.append(socket)
            tasks.create_task(self._read(socket))

        async with asyncio.TaskGroup() as opening:
            for _ in range(count):
                opening.create_task(open_one())

    async def _read(self, socket: ClientConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in socket:
                message = decode_server_message(frame)
                if isinstance(message, Token):
                    self.num_tokens += 1
                elif isinstance(message, Done):
                    self.num_done += 1
                elif isinstance(message, Error):
                    self.num_errors += 1
                self.progress.set()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                self.progress.clear()
                await self.progress.wait()


def _at_least(clients: Clients, num_tokens: int) -> bool:
    return clients.num_tokens >= num_tokens


async def _fake_worker(redis_url: str, count: int, num_tokens: int, clients: Clients) -> float:
    """Read ``count`` submitted requests, publish their tokens; returns the seconds taken."""
    keys = RedisKeys()
    redis = aioredis.Redis.from_url(redis_url)
    requests: list[SubmitRequest] = []
    last_id = "0-0"
    async with asyncio.timeout(PHASE_TIMEOUT_S):
        while len(requests) + clients.num_errors < count:
            answer: list[tuple[bytes, list[tuple[str, dict[bytes, bytes]]]]]
            answer = await redis.xread({keys.requests: last_id}, count=1000, block=1000)  # type: ignore[assignment]
            for _, entries in answer:
                for entry_id, fields in entries:
                    last_id = entry_id
                    message = decode_control_message(fields[MESSAGE_FIELD.encode()])
                    if isinstance(message, SubmitRequest):
                        requests.append(message)
    count = len(requests)
    channel = keys.tokens(requests[0].gateway_id)
    started_s = time.monotonic()
    for step in range(num_tokens):
        needed = (step - STEPS_AHEAD) * count
        await clients.wait_for(partial(_at_least, clients, needed), PHASE_TIMEOUT_S)
        last = step == num_tokens - 1
        tokens = [
            SampledToken(
                request.request_id,
                TOKEN_IDS[step % len(TOKEN_IDS)],
                step,
                "length" if last else None,
            )
            for request in requests
        ]
        await redis.publish(channel, encode(TokenBatch(worker_id="capacity", tokens=tokens)))
    await clients.wait_for(lambda: clients.num_done >= count, PHASE_TIMEOUT_S)
    await redis.aclose()
    return time.monotonic() - started_s


async def _measure(url: str, pid: int, redis_url: str, args: argparse.Namespace) -> dict:
    clients = Clients()
    async with asyncio.TaskGroup() as tasks:
        started_s = time.monotonic()
        await clients.open(url, args.sockets, tasks)
        open_s = time.monotonic() - started_s
        idle_before = ProcessSample.of(pid)
        await asyncio.sleep(args.hold_s)
        pongs = await asyncio.gather(*(socket.ping() for socket in clients.sockets))
        await asyncio.wait_for(asyncio.gather(*pongs), 60)
        idle_after = ProcessSample.of(pid)
        for index, socket in enumerate(clients.sockets):
            generate = Generate(
                id=f"c{index}",
                prompt_token_ids=[1_000, 1_001, 1_002],
                max_tokens=args.tokens,
                ignore_eos=True,
            )
            await socket.send(encode_json(generate))
            if index % SEND_WAVE == SEND_WAVE - 1:
                await asyncio.sleep(SEND_WAVE_PAUSE_S)
        busy_before = ProcessSample.of(pid)
        fanout_s = await _fake_worker(redis_url, args.sockets, args.tokens, clients)
        busy_after = ProcessSample.of(pid)
        for socket in clients.sockets:
            await socket.close()
    return {
        "num_sockets": args.sockets,
        "open_s": open_s,
        "hold_s": args.hold_s,
        "num_alive_after_hold": len(pongs),
        "num_request_errors": clients.num_errors,
        "idle": {
            "gateway_cpu": _cpu_share(idle_before, idle_after, args.hold_s),
            "gateway_rss_mib": idle_after.rss_mib,
        },
        "fanout": {
            "tokens_per_socket": args.tokens,
            "num_tokens": clients.num_tokens,
            "seconds": fanout_s,
            "tokens_per_s": clients.num_tokens / fanout_s,
            "gateway_cpu": _cpu_share(busy_before, busy_after, fanout_s),
            "gateway_rss_mib": busy_after.rss_mib,
        },
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orcapod bench capacity", description=__doc__)
    parser.add_argument("--sockets", type=int, default=1000)
    parser.add_argument("--hold-s", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=50, help="tokens sent to each socket")
    parser.add_argument("--model", help="model dir whose tokenizer the gateway loads")
    parser.add_argument("--out", type=Path, default=Path("bench/results/capacity.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``orcapod bench capacity``."""
    args = _parser().parse_args(argv)
    if not 1 <= args.sockets <= MAX_SOCKETS:
        print(f"orcapod bench capacity: --sockets must be in [1, {MAX_SOCKETS}]")
        return 2
    with (
        benchmark_redis() as redis,
        one_gateway(redis.url, "capacity", args.out.with_suffix(".log"), args.model) as (
            url,
            pid,
        ),
    ):
        result = asyncio.run(_measure(url, pid, redis.url, args))
    result["machine"] = machine()
    fanout, idle = result["fanout"], result["idle"]
    print(
        f"\n{result['num_alive_after_hold']}/{args.sockets} sockets open for {args.hold_s:.0f} s "
        f"(opened in {result['open_s']:.1f} s); idle gateway {idle['gateway_cpu']:.1%} CPU, "
        f"{idle['gateway_rss_mib']:.0f} MiB RSS\n"
        f"fan-out: {fanout['num_tokens']} tokens in {fanout['seconds']:.1f} s = "
        f"{fanout['tokens_per_s']:.0f} tokens/s to {args.sockets} sockets "
        f"({result['num_request_errors']} requests refused); gateway "
        f"{fanout['gateway_cpu']:.0%} of a core, {fanout['gateway_rss_mib']:.0f} MiB RSS"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0
