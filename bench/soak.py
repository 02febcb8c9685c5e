"""Load and soak of the whole service: 1,000 clients on one gateway, then a steady soak.

    python -m bench.soak                                 # 1,000 clients, 300 s soak
    python -m bench.soak --duration-s 20 --clients 100   # quick smoke run (make soak-quick)

Starts its own password-protected redis-server and ``orcapod up`` (one
gateway, one worker, the embedded model), everything on 127.0.0.1, then:

1. burst: opens ``--clients`` websockets on the one gateway (50 handshakes at
   a time) and sends one short request on each (``--max-tokens``, at most 8,
   ``ignore_eos``), all at once; every request must be answered (``done`` or
   an ``error``) within ``--burst-deadline-s``;
2. soak: keeps those sockets open and sends ``--rate`` requests/s round-robin
   over them for ``--duration-s``; every 10th request goes on a fresh socket
   that closes after its answer, so sockets open and close all along. Every
   ``--sample-every-s`` it reads the resident memory (``/proc/PID/status``
   VmRSS) and open file descriptors (``/proc/PID/fd``) of the gateway, the
   scheduler, the worker and redis-server.

Checks: every request answered; per process, RSS growth from the first sample
after ``--warmup-s`` to the last one under 5 %; open fds at those two points
not growing. Prints a table, writes ``soak.json`` under ``--out``; exit status
1 when a check fails. The whole run has a hard deadline. The clients run in
this process, on the same cores as the service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from bench.output import RESULTS_DIR, print_checks, write_json
from orcapod.bench.loadgen import check_loopback
from orcapod.bench.run import StatsReader, machine
from orcapod.bench.service import benchmark_redis, orcapod_up
from orcapod.bench.soak_samples import (
    Growth,
    ProcessSample,
    RedisCensus,
    census_growth,
    growth,
    read_sample,
    redis_census,
    service_pids,
)
from shared.keys import RedisKeys
from shared.protocol import Done, Error, Token, decode_server_message

OPEN_CONCURRENCY = 50
CHURN_EVERY = 10
PROMPTS = ("Hi", "Hello there", "Name a color.", "Count to three.", "What is 2+2?")
ROLES = ("gateway", "scheduler", "worker", "redis")


# --- the clients ---------------------------------------------------------------------


@dataclass
class Tally:
    """Every request sent, and how each ended."""

    sent: int = 0
    done: int = 0
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    outstanding: dict[str, float] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)

    def start(self, client_id: str) -> None:
        self.sent += 1
        self.outstanding[client_id] = time.monotonic()

    def finish(self, client_id: str, error: str | None = None, tokens: int = 0) -> None:
        sent_s = self.outstanding.pop(client_id, None)
        if sent_s is None:
            return
        if error is None:
            self.done += 1
            self.tokens += tokens
            self.latencies_s.append(time.monotonic() - sent_s)
        else:
            self.errors[error] += 1

    def summary(self) -> dict[str, object]:
        latencies = sorted(self.latencies_s)
        return {
            "sent": self.sent,
            "answered": self.sent - len(self.outstanding),
            "done": self.done,
            "errors": dict(self.errors),
            "unanswered": len(self.outstanding),
            "tokens": self.tokens,
            "latency_p50_s": _percentile(latencies, 0.5),
            "latency_p99_s": _percentile(latencies, 0.99),
        }


def _percentile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def generate_frame(client_id: str, number: int, max_tokens: int) -> str:
    """A short request: a few prompt tokens, 4 to ``max_tokens`` generated, EOS ignored."""
    return json.dumps(
        {
            "type": "generate",
            "id": client_id,
            "prompt": PROMPTS[number % len(PROMPTS)],
            "max_tokens": 4 + number % (max_tokens - 3),
            "temperature": 0,
            "ignore_eos": True,
        }
    )


class Client:
    """One websocket and its reader, which ends each request in its phase's tally."""

    def __init__(self, connection: ClientConnection) -> None:
        self.connection = connection
        self._mine: dict[str, Tally] = {}

    async def send(self, client_id: str, frame: str, tally: Tally) -> None:
        tally.start(client_id)
        self._mine[client_id] = tally
        try:
            await self.connection.send(frame)
        except ConnectionClosed as error:
            self._end(client_id, f"socket closed: {error.rcvd}")

    async def read(self) -> None:
        """Until the socket closes; what is then still open ends as an error."""
        try:
            async for raw in self.connection:
                message = decode_server_message(raw)
                if isinstance(message, Done) and message.id is not None:
                    self._end(message.id, tokens=message.usage.completion_tokens)
                elif isinstance(message, Error) and message.id is not None:
                    self._end(message.id, message.code)
                elif isinstance(message, Token):
                    continue
        except ConnectionClosed:
            pass
        for client_id in list(self._mine):
            self._end(client_id, "socket closed")

    @property
    def idle(self) -> bool:
        return not self._mine

    def _end(self, client_id: str, error: str | None = None, tokens: int = 0) -> None:
        tally = self._mine.pop(client_id, None)
        if tally is not None:
            tally.finish(client_id, error, tokens)


async def open_client(url: str, gate: asyncio.Semaphore) -> Client:
    async with gate:
        connection = await connect(url, open_timeout=60, max_queue=None, ping_timeout=None)
    return Client(connection)


async def wait_answered(tally: Tally, deadline_s: float) -> None:
    """Until nothing is outstanding or the (monotonic) deadline passes."""
    while tally.outstanding and time.monotonic() < deadline_s:
        await asyncio.sleep(0.1)


# --- the run -------------------------------------------------------------------------


@dataclass
class Sampler:
    """RSS and fds of each service process, every ``every_s`` seconds."""

    pids: dict[str, int]
    every_s: float
    redis: aioredis.Redis
    started_s: float = field(default_factory=time.monotonic)
    samples: dict[str, list[ProcessSample]] = field(default_factory=dict)
    census: list[RedisCensus] = field(default_factory=list)
    loadavg: list[tuple[float, float]] = field(default_factory=list)

    async def sample(self) -> None:
        t_s = round(time.monotonic() - self.started_s, 2)
        for role, pid in self.pids.items():
            self.samples.setdefault(role, []).append(read_sample(pid, t_s))
        self.loadavg.append((t_s, round(os.getloadavg()[0], 2)))
        self.census.append(await redis_census(self.redis, RedisKeys(), t_s))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)


async def burst(
    url: str, args: argparse.Namespace, tasks: asyncio.TaskGroup
) -> tuple[list[Client], dict]:
    """Phase 1: ``--clients`` sockets, one request each, all answered by the deadline."""
    tally = Tally()
    gate = asyncio.Semaphore(OPEN_CONCURRENCY)
    started_s = time.monotonic()
    clients = list(await asyncio.gather(*(open_client(url, gate) for _ in range(args.clients))))
    opened_s = time.monotonic() - started_s
    for client in clients:
        tasks.create_task(client.read())
    sent_s = time.monotonic()
    for number, client in enumerate(clients):
        frame = generate_frame(f"b{number}", number, args.max_tokens)
        await client.send(f"b{number}", frame, tally)
    await wait_answered(tally, sent_s + args.burst_deadline_s)
    result = {
        "clients": len(clients),
        "open_s": round(opened_s, 2),
        "answer_wall_s": round(time.monotonic() - sent_s, 2),
        **tally.summary(),
    }
    return clients, result


async def one_shot(url: str, tally: Tally, client_id: str, frame: str, give_up_s: float) -> None:
    """A socket for one request, closed after its answer (or at ``give_up_s``)."""
    try:
        connection = await connect(url, open_timeout=30)
    except (OSError, InvalidHandshake, TimeoutError) as error:
        tally.start(client_id)
        tally.finish(client_id, f"connect failed: {type(error).__name__}")
        return
    client = Client(connection)
    async with asyncio.TaskGroup() as reading:
        reading.create_task(client.read())
        await client.send(client_id, frame, tally)
        while not client.idle and time.monotonic() < give_up_s:
            await asyncio.sleep(0.05)
        await connection.close()


async def soak(
    url: str,
    clients: list[Client],
    sampler: Sampler,
    args: argparse.Namespace,
    tasks: asyncio.TaskGroup,
) -> dict:
    """Phase 2: ``--rate`` requests/s for ``--duration-s``, sampling all along."""
    tally = Tally()
    stop_sampling = asyncio.Event()
    sampler.started_s = time.monotonic()
    sampling = tasks.create_task(sampler.run(stop_sampling))
    interval_s = 1.0 / args.rate
    end_s = sampler.started_s + args.duration_s
    next_s = sampler.started_s
    one_shots: list[asyncio.Task[None]] = []
    for number in itertools.count():
        if next_s >= end_s:
            break
        await asyncio.sleep(max(0.0, next_s - time.monotonic()))
        client_id = f"s{number}"
        frame = generate_frame(client_id, number, args.max_tokens)
        if number % CHURN_EVERY == CHURN_EVERY - 1:
            give_up_s = end_s + args.drain_s
            one_shots.append(tasks.create_task(one_shot(url, tally, client_id, frame, give_up_s)))
        else:
            await clients[number % len(clients)].send(client_id, frame, tally)
        next_s += interval_s
    # A one-shot counts its request once connected: wait for them, then for the rest.
    if one_shots:
        await asyncio.wait(one_shots)
    await wait_answered(tally, time.monotonic() + args.drain_s)
    await sampler.sample()  # the last sample: after the last answer
    stop_sampling.set()
    await sampling
    return {"duration_s": args.duration_s, "rate_rps": args.rate, **tally.summary()}


async def drive(
    url: str, pids: dict[str, int], args: argparse.Namespace, redis_url: str
) -> tuple[dict, dict, Sampler]:
    """The burst, then the soak, on one set of sockets; closes them at the end."""
    stats = StatsReader(redis_url, RedisKeys().prefix)
    sampler = Sampler(pids, args.sample_every_s, aioredis.Redis.from_url(redis_url))
    async with contextlib.AsyncExitStack() as cleanup, asyncio.TaskGroup() as tasks:
        cleanup.callback(stats.close)
        cleanup.push_async_callback(sampler.redis.aclose)
        clients, burst_result = await burst(url, args, tasks)
        print(f"burst: {json.dumps(burst_result)}", flush=True)
        counters_before, _ = stats.snapshot()
        soak_started_s = time.monotonic()
        soak_result = await soak(url, clients, sampler, args, tasks)
        counters_after, _ = stats.snapshot()
        soak_wall_s = time.monotonic() - soak_started_s
        busy_s = counters_after.get("busy_s", 0.0) - counters_before.get("busy_s", 0.0)
        soak_result["engine_busy_fraction"] = round(busy_s / soak_wall_s, 3)
        soak_result["tokens_per_s"] = round(soak_result["tokens"] / soak_wall_s, 1)
        for client in clients:
            await client.connection.close()
    return burst_result, soak_result, sampler


def report(
    burst_result: dict, soak_result: dict, sampler: Sampler, args: argparse.Namespace
) -> tuple[dict, dict[str, Growth], dict[str, bool]]:
    """The JSON document and the verdicts."""
    growths = {role: growth(sampler.samples[role], args.warmup_s) for role in ROLES}
    redis_keys = census_growth(sampler.census, args.warmup_s)
    checks = {
        "burst: every request answered": burst_result["unanswered"] == 0,
        "soak: every request answered": soak_result["unanswered"] == 0,
        **{f"{role}: RSS growth < 5 %": g.rss_ok for role, g in growths.items()},
        **{f"{role}: no fd leak": g.fds_ok for role, g in growths.items()},
        "redis: no key without a TTL added": (
            redis_keys["keys_without_ttl_end"] <= redis_keys["keys_without_ttl_start"]
        ),
    }
    document = {
        "machine": machine(),
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "loadavg_1m_during": sampler.loadavg,
        "burst": burst_result,
        "soak": soak_result,
        "processes": {
            role: {
                "pid": sampler.pids[role],
                **asdict(g),
                "samples": [asdict(s) for s in sampler.samples[role]],
            }
            for role, g in growths.items()
        },
        "redis_keys": {
            **redis_keys,
            "request_log_retention_s": args.log_retention_s,
            "census": [asdict(sample) for sample in sampler.census],
        },
        "checks": checks,
    }
    return document, growths, checks


def print_table(document: dict, growths: dict[str, Growth], checks: dict[str, bool]) -> None:
    burst_result, soak_result = document["burst"], document["soak"]
    loads = [load for _, load in document["loadavg_1m_during"]]
    print()
    print(
        f"burst: {burst_result['clients']} clients (opened in {burst_result['open_s']} s), "
        f"{burst_result['sent']} sent, {burst_result['done']} done, errors "
        f"{burst_result['errors'] or 0}, unanswered {burst_result['unanswered']}, "
        f"all answered in {burst_result['answer_wall_s']} s"
    )
    print(
        f"soak: {soak_result['duration_s']} s at {soak_result['rate_rps']}/s: "
        f"{soak_result['sent']} sent, {soak_result['done']} done, errors "
        f"{soak_result['errors'] or 0}, unanswered {soak_result['unanswered']}, "
        f"{soak_result['tokens']} tokens ({soak_result['tokens_per_s']}/s), "
        f"latency p50 {soak_result['latency_p50_s']} s p99 {soak_result['latency_p99_s']} s, "
        f"engine busy {soak_result['engine_busy_fraction']}"
    )
    print(f"load average (1 min) during the soak: {min(loads)}–{max(loads)}")
    print()
    print("| process | RSS start MiB | RSS end MiB | growth % | peak MiB | fds start | fds end |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for role, g in growths.items():
        print(
            f"| {role} | {g.rss_start_mib} | {g.rss_end_mib} | {g.rss_growth_pct:+.2f} | "
            f"{g.rss_peak_mib} | {g.fds_start} | {g.fds_end} |"
        )
    keys = document["redis_keys"]
    print()
    print(
        f"redis: {keys['keys_start']} -> {keys['keys_end']} keys, of which request logs "
        f"{keys['request_logs_start']} -> {keys['request_logs_end']} (each kept "
        f"{keys['request_log_retention_s']} s after its request ends) and without a TTL "
        f"{keys['keys_without_ttl_start']} -> {keys['keys_without_ttl_end']}; used_memory "
        f"{keys['used_memory_start_kib'] / 1024:.1f} -> "
        f"{keys['used_memory_end_kib'] / 1024:.1f} MiB"
    )
    print()
    print_checks(checks)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--clients", type=int, default=1000, help="websockets on the gateway")
    parser.add_argument("--duration-s", type=float, default=300.0, help="length of the soak")
    parser.add_argument("--rate", type=float, default=2.0, help="soak requests per second")
    parser.add_argument("--max-tokens", type=int, default=8, help="4 to this many (<= 8)")
    parser.add_argument(
        "--log-retention-s",
        type=int,
        default=60,
        help="how long the service keeps a finished request's log (its default is 600 s; "
        "shorter here so Redis reaches its steady size within the warm-up)",
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="RSS baseline after this (default: the log retention + 30 s)",
    )
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--burst-deadline-s", type=float, default=300.0)
    parser.add_argument("--drain-s", type=float, default=120.0, help="answers after the soak")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "soak")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; 0 when every check passes."""
    args = _parser().parse_args(argv)
    if not 1 <= args.clients <= 5000 or not 4 <= args.max_tokens <= 8 or args.rate <= 0:
        print("soak: --clients 1..5000, --max-tokens 4..8, --rate > 0", file=sys.stderr)
        return 2
    if args.warmup_s is None:
        args.warmup_s = args.log_retention_s + 30.0
    if args.warmup_s + 2 * args.sample_every_s > args.duration_s:
        # A quick run still needs two samples after its warm-up.
        args.warmup_s = max(0.0, args.duration_s / 3)
    hard_deadline_s = args.burst_deadline_s + args.duration_s + args.drain_s + 300
    args.out.mkdir(parents=True, exist_ok=True)
    up_args = [
        "--worker-arg=--kv-cache-bytes=268435456",
        # Room for the whole burst to be admitted in few waves.
        "--scheduler-arg=--max-batch-size=128",
    ]
    with (
        benchmark_redis() as redis,
        orcapod_up(
            redis.url,
            "fair",
            args.out / "up.log",
            up_args,
            {"ORCAPOD_LOG_RETENTION_S": str(args.log_retention_s)},
        ) as url,
    ):
        check_loopback(url)
        port = urlsplit(url).port
        assert port is not None
        pids = service_pids(port, redis.child.pid)
        print(f"service up at {url}: {pids}; load average {os.getloadavg()[0]:.2f}")

        async def bounded() -> tuple[dict, dict, Sampler]:
            async with asyncio.timeout(hard_deadline_s):
                return await drive(url, pids, args, redis.url)

        try:
            burst_result, soak_result, sampler = asyncio.run(bounded())
        except TimeoutError:
            print(f"soak: hard deadline of {hard_deadline_s:.0f} s reached", file=sys.stderr)
            return 1
    document, growths, checks = report(burst_result, soak_result, sampler, args)
    write_json(args.out / "soak.json", document, indent=1)
    print_table(document, growths, checks)
    print(f"\nwrote {args.out / 'soak.json'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
