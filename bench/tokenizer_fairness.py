"""One tenant flooding the tokenizer against another tenant's small requests.

    python -m bench.tokenizer_fairness                     # 30 s per phase
    python -m bench.tokenizer_fairness --duration-s 10     # quick

Starts its own redis-server and ``orcapod up`` (one gateway, one worker, the
embedded model, everything on 127.0.0.1) with a tenants file of two tenants:
``bob``, the attacker, with the quotas of the audit (max_in_flight 4,
max_queued 8, tokens_per_minute 3000), and ``carol``, the victim, with none.
Then:

1. unloaded: carol sends a small request (``--victim-max-tokens`` tokens,
   ``ignore_eos``) every ``--interval-s`` for ``--duration-s`` on one socket;
   of each: its time to first token (sent to its first ``token`` frame) and
   how it ended;
2. flood: a second process opens ``--attack-sockets`` sockets as bob, each
   sending a ``--attack-chars`` prompt again as soon as it is answered; once
   every one has sent, carol does as in 1;
3. burst: ``--burst`` sockets of carol send one small request each, at once.

``--attack-prompt evasive`` (the default) is ``"# "`` repeated: its bytes
alone say it has at least ~1,200 tokens, so it passes every check made
before tokenizing, is tokenized in full (about 80 ms of a core for 100,000
characters) and only then refused (``prompt_too_long``: 50,000 tokens).
``prose`` (words) is refused from its bytes alone (over bob's tokens per
minute), without tokenizing.

Checks: every request of carol served (``done``) in both phases and in the
burst; carol's median time to first token under the flood within
``--max-ttft-factor`` (3) of the unloaded one. Prints a table, writes
``tokenizer_fairness.json`` under ``--out``; exit status 1 when a check fails.
The clients run on the same cores as the service (the attacker in a process
of its own, as another client would).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import secrets
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from bench.output import RESULTS_DIR, print_checks, write_json
from gateway.tenants import hash_key
from orcapod.bench.loadgen import check_loopback
from orcapod.bench.run import machine
from orcapod.bench.service import benchmark_redis, orcapod_up

ATTACKER, VICTIM = "bob", "carol"
ATTACKER_QUOTAS = {"max_in_flight": 4, "max_queued": 8, "tokens_per_minute": 3000}
# The gateway's own defaults: orcapod_up lifts them for load generators.
GATEWAY_DEFAULT_CAPS = {
    "ORCAPOD_MAX_REQUESTS_PER_TENANT": "256",
    "ORCAPOD_DEFAULT_MAX_QUEUED": "256",
}
VICTIM_MESSAGES = [{"role": "user", "content": "Say hello."}]
OPEN_TIMEOUT_S = 60.0
ANSWER_TIMEOUT_S = 120.0


@dataclass
class Phase:
    """What carol got in one phase."""

    name: str
    ttfts_s: list[float] = field(default_factory=list)
    ends: Counter[str] = field(default_factory=Counter)

    @property
    def num_requests(self) -> int:
        return self.ends.total()

    @property
    def num_served(self) -> int:
        return self.ends["done"]

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.ttfts_s)
        return {
            "requests": self.num_requests,
            "served": self.num_served,
            "ends": dict(self.ends),
            "ttft_p50_ms": _ms(statistics.median(ordered)) if ordered else None,
            "ttft_p90_ms": _ms(_percentile(ordered, 0.9)),
            "ttft_max_ms": _ms(ordered[-1]) if ordered else None,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _percentile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def attack_prompt(kind: str, num_chars: int) -> str:
    """``evasive``: passes the check before tokenizing; ``prose``: does not."""
    unit = "# " if kind == "evasive" else "the quick brown fox jumps over the lazy dog "
    return (unit * (num_chars // len(unit) + 1))[:num_chars]


def tenants_toml(keys: dict[str, str]) -> str:
    """bob with the audit's quotas, carol with none."""
    quotas = "".join(f"{name} = {value}\n" for name, value in ATTACKER_QUOTAS.items())
    return (
        f'[tenants.{ATTACKER}]\n{quotas}key_sha256 = ["{hash_key(keys[ATTACKER])}"]\n'
        f'[tenants.{VICTIM}]\nkey_sha256 = ["{hash_key(keys[VICTIM])}"]\n'
    )


async def _open(url: str, key: str) -> ClientConnection:
    headers = {"Authorization": f"Bearer {key}"}
    return await connect(
        url, additional_headers=headers, open_timeout=OPEN_TIMEOUT_S, close_timeout=1
    )


async def _ask(
    socket: ClientConnection, client_id: str, max_tokens: int
) -> tuple[str, float | None]:
    """One request of carol on ``socket``: how it ended, and its time to first
    token (None without one)."""
    frame = {
        "type": "generate",
        "id": client_id,
        "messages": VICTIM_MESSAGES,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    sent_s = time.monotonic()
    await socket.send(json.dumps(frame))
    ttft_s: float | None = None
    async with asyncio.timeout(ANSWER_TIMEOUT_S):
        while True:
            reply = json.loads(await socket.recv())
            if reply.get("id") != client_id:
                continue
            if reply["type"] == "token" and ttft_s is None:
                ttft_s = time.monotonic() - sent_s
            if reply["type"] == "done":
                return "done", ttft_s
            if reply["type"] == "error":
                return reply["code"], ttft_s


async def victim(url: str, key: str, phase: Phase, args: argparse.Namespace) -> None:
    """carol: a request every ``--interval-s`` for ``--duration-s`` (after one
    unmeasured request, so both phases find the prompt's prefix cached)."""
    socket = await _open(url, key)
    try:
        await _ask(socket, f"{phase.name}-warmup", args.victim_max_tokens)
        end_s = time.monotonic() + args.duration_s
        number = 0
        while time.monotonic() < end_s:
            started_s = time.monotonic()
            ended, ttft_s = await _ask(socket, f"{phase.name}{number}", args.victim_max_tokens)
            phase.ends[ended] += 1
            if ended == "done" and ttft_s is not None:
                phase.ttfts_s.append(ttft_s)
            number += 1
            await asyncio.sleep(max(0.0, started_s + args.interval_s - time.monotonic()))
    finally:
        await socket.close()


async def burst(url: str, key: str, num_requests: int, max_tokens: int) -> Counter[str]:
    """``num_requests`` sockets of carol, one request each, sent at once."""
    sockets = await asyncio.gather(*(_open(url, key) for _ in range(num_requests)))
    try:
        ends = await asyncio.gather(*(_ask(socket, "b", max_tokens) for socket in sockets))
    finally:
        await asyncio.gather(*(socket.close() for socket in sockets))
    return Counter(ended for ended, _ in ends)


async def _flood_socket(
    url: str, key: str, frame: str, replies: Counter[str], sending: list[None]
) -> None:
    socket = await _open(url, key)
    try:
        await socket.send(frame)
        sending.append(None)
        while True:
            reply = json.loads(await socket.recv())
            if reply["type"] == "error":
                own = reply["code"] == "queue_full" and "tokenizer queue" in reply["message"]
                replies["queue_full (own tokenizer queue)" if own else reply["code"]] += 1
                await socket.send(frame)
            elif reply["type"] == "done":
                replies["done"] += 1
                await socket.send(frame)
    finally:
        await socket.close()


async def _flood(
    url: str, key: str, args: argparse.Namespace, ready: ProcessEvent, stop: ProcessEvent
) -> dict[str, int]:
    frame = json.dumps(
        {
            "type": "generate",
            "id": "a",
            "prompt": attack_prompt(args.attack_prompt, args.attack_chars),
            "max_tokens": 8,
        }
    )
    replies: Counter[str] = Counter()
    sending: list[None] = []
    async with asyncio.TaskGroup() as tasks:
        sockets = [
            tasks.create_task(_flood_socket(url, key, frame, replies, sending))
            for _ in range(args.attack_sockets)
        ]
        try:
            while len(sending) < args.attack_sockets:
                await asyncio.sleep(0.05)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
        finally:
            for task in sockets:
                task.cancel()
    return dict(replies)


def attacker_process(
    url: str,
    key: str,
    args: argparse.Namespace,
    ready: ProcessEvent,
    stop: ProcessEvent,
    results: multiprocessing.Queue[dict[str, int]],
) -> None:
    """The attacker's own process: floods until ``stop``, then reports its replies."""
    results.put(asyncio.run(_flood(url, key, args, ready, stop)))


async def flood_phase(
    url: str, keys: dict[str, str], args: argparse.Namespace
) -> tuple[Phase, dict[str, int]]:
    """carol's requests while bob floods from another process."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    results: multiprocessing.Queue[dict[str, int]] = context.Queue()
    attacker = context.Process(
        target=attacker_process, args=(url, keys[ATTACKER], args, ready, stop, results)
    )
    attacker.start()
    try:
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, ready.wait, OPEN_TIMEOUT_S):
            raise RuntimeError("the attacker's sockets did not all open")
        await asyncio.sleep(1.0)  # the attack in full swing
        phase = Phase("flood")
        await victim(url, keys[VICTIM], phase, args)
    finally:
        stop.set()
    replies = await asyncio.get_running_loop().run_in_executor(None, results.get, True, 60.0)
    attacker.join(timeout=30)
    return phase, replies


async def drive(url: str, keys: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    unloaded = Phase("unloaded")
    await victim(url, keys[VICTIM], unloaded, args)
    print(f"unloaded: {json.dumps(unloaded.summary())}", flush=True)
    flooded, replies = await flood_phase(url, keys, args)
    print(f"flood: {json.dumps(flooded.summary())}; attacker {replies}", flush=True)
    burst_ends = (
        await burst(url, keys[VICTIM], args.burst, args.victim_max_tokens) if args.burst else None
    )
    return {
        "unloaded": unloaded.summary(),
        "flood": flooded.summary(),
        "attacker_replies": replies,
        "burst": None if burst_ends is None else dict(burst_ends),
    }


def checks_of(result: dict[str, Any], args: argparse.Namespace) -> dict[str, bool]:
    """The pass/fail lines of a run."""
    unloaded, flooded = result["unloaded"], result["flood"]
    checks = {
        "every victim request served, unloaded": unloaded["served"] == unloaded["requests"],
        "every victim request served, under the flood": flooded["served"] == flooded["requests"],
        f"victim TTFT p50 under the flood within {args.max_ttft_factor:g}x of unloaded": (
            unloaded["ttft_p50_ms"] is not None
            and flooded["ttft_p50_ms"] is not None
            and flooded["ttft_p50_ms"] <= args.max_ttft_factor * unloaded["ttft_p50_ms"]
        ),
    }
    if result["burst"] is not None:
        checks[f"a burst of {args.burst} small requests all served"] = result["burst"] == {
            "done": args.burst
        }
    return checks


def print_table(document: dict[str, Any], checks: dict[str, bool]) -> None:
    result = document["result"]
    print()
    print("| phase | victim requests | served | refused | TTFT p50 ms | p90 ms | max ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in ("unloaded", "flood"):
        phase = result[name]
        refused = {code: n for code, n in phase["ends"].items() if code != "done"}
        print(
            f"| {name} | {phase['requests']} | {phase['served']} | {refused or 0} | "
            f"{phase['ttft_p50_ms']} | {phase['ttft_p90_ms']} | {phase['ttft_max_ms']} |"
        )
    settings = document["settings"]
    print()
    print(
        f"attacker: {settings['attack_sockets']} sockets of {settings['attack_chars']:,}-character "
        f"{settings['attack_prompt']} prompts; its replies: {result['attacker_replies']}"
    )
    if result["burst"] is not None:
        print(f"burst of {settings['burst']} at once: {result['burst']}")
    print(f"machine: {document['machine']['cpu']}, {document['machine']['cores']} cores")
    print()
    print_checks(checks)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="the victim's time to first token while another tenant floods the tokenizer"
    )
    parser.add_argument("--duration-s", type=float, default=30.0, help="victim time per phase")
    parser.add_argument("--interval-s", type=float, default=0.5, help="between victim requests")
    parser.add_argument("--victim-max-tokens", type=int, default=4)
    parser.add_argument("--attack-sockets", type=int, default=64)
    parser.add_argument("--attack-chars", type=int, default=100_000)
    parser.add_argument("--attack-prompt", choices=("evasive", "prose"), default="evasive")
    parser.add_argument("--burst", type=int, default=150, help="0: no burst")
    parser.add_argument("--max-ttft-factor", type=float, default=3.0)
    parser.add_argument(
        "--up-arg",
        action="append",
        default=[],
        help="one more argument for orcapod up, e.g. --up-arg=--gateway-arg=--max-tokenizing=64",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "tokenizer_fairness")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; 0 when every check passes."""
    args = _parser().parse_args(argv)
    if args.duration_s <= 0 or args.interval_s <= 0 or args.attack_sockets < 1:
        print("tokenizer_fairness: --duration-s, --interval-s > 0, --attack-sockets >= 1")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    keys = {name: f"opk_bench_{secrets.token_urlsafe(16)}" for name in (ATTACKER, VICTIM)}
    tenants_path = args.out / "tenants.toml"
    tenants_path.write_text(tenants_toml(keys), encoding="utf-8")
    up_args = [
        *("--tenants-file", str(tenants_path)),
        "--worker-arg=--kv-cache-bytes=268435456",
        *args.up_arg,
    ]
    document: dict[str, Any] = {"machine": machine(), "settings": vars(args) | {"out": None}}
    hard_deadline_s = 2 * args.duration_s + 600
    with (
        benchmark_redis() as redis,
        orcapod_up(redis.url, "fair", args.out / "up.log", up_args, GATEWAY_DEFAULT_CAPS) as url,
    ):
        check_loopback(url)
        print(f"service up at {url}; load average {os.getloadavg()[0]:.2f}", flush=True)

        async def bounded() -> dict[str, Any]:
            async with asyncio.timeout(hard_deadline_s):
                return await drive(url, keys, args)

        try:
            document["result"] = asyncio.run(bounded())
        except TimeoutError:
            print(f"tokenizer_fairness: hard deadline of {hard_deadline_s:.0f} s reached")
            return 1
    checks = checks_of(document["result"], args)
    document["checks"] = checks
    write_json(args.out / "tokenizer_fairness.json", document, indent=1)
    print_table(document, checks)
    print(f"\nwrote {args.out / 'tokenizer_fairness.json'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
