"""The heaviest frames the limits allow, sent in a loop on other sockets, do not
hold a normal stream up: its inter-token gaps stay near their baseline.

The strict bound (p99 within 2x, with the engine out of the picture) is
tests/gateway's; here the whole service shares two cores with the attacker's
tokenizing, so the bound is looser and the point is that nothing stalls."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics

from tests.adversarial.service import Client, Service, open_socket

HEAVY_PROMPT = "word " * 19_999 + "word"  # 100,000 characters
HEAVY_STOP = ["s" * 64 for _ in range(16)]  # 1,024 bytes
# Enough gaps that a p99 is not one gap: on a 2-core VM a lone stream's single
# slowest gap varies several-fold from run to run, attacker or not.
VICTIM_TOKENS = 96
# What the attacker's tokenizing may add to the victim's p99 gap: on two cores the
# worker's step waits for a core while a 100,000-character prompt is tokenized
# (about 80 ms of one): p99 160 to 220 ms under attack against 36 to 64 alone
# in the suite's runs. A stalled loop adds seconds.
CPU_SHARE_SLACK_S = 0.25


def _gaps_s(client: Client, client_id: str) -> list[float]:
    times = client.arrivals_s[client_id]
    return [b - a for a, b in itertools.pairwise(times)]


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def _stream(service: Service, name: str) -> list[float]:
    async with open_socket(service, "victim") as socket:
        client = Client(socket)
        outcome = await client.ask(name, max_tokens=VICTIM_TOKENS, ignore_eos=True)
        assert outcome.end is not None and outcome.end["type"] == "done", outcome.frames
        return _gaps_s(client, name)[2:]  # after `accepted` and the first token


async def _heavy_frames(service: Service, stop: asyncio.Event) -> int:
    num_sent = 0
    async with open_socket(service, "attacker") as socket:
        while not stop.is_set():
            frame = {"type": "generate", "id": f"h{num_sent}", "prompt": HEAVY_PROMPT}
            await socket.send(json.dumps({**frame, "stop": HEAVY_STOP}))
            json.loads(await socket.recv())  # prompt_too_long, after tokenizing
            num_sent += 1
    return num_sent


def test_heavy_frames_do_not_stall_a_stream(service: Service) -> None:
    async def run() -> tuple[list[float], list[float], int]:
        baseline = await _stream(service, "alone")
        stop = asyncio.Event()
        attackers = [asyncio.create_task(_heavy_frames(service, stop)) for _ in range(2)]
        try:
            loaded = await _stream(service, "loaded")
        finally:
            stop.set()
            counts = await asyncio.gather(*attackers)
        return baseline, loaded, sum(counts)

    baseline, loaded, num_heavy = asyncio.run(run())
    print(
        f"{num_heavy} heaviest frames: victim ITL p99 {_p99(baseline) * 1000:.0f} ms alone, "
        f"{_p99(loaded) * 1000:.0f} ms under attack (max {max(loaded) * 1000:.0f} ms)"
    )
    assert num_heavy >= 10
    assert max(loaded) < 1.0, max(loaded)
    assert _p99(loaded) < 3 * _p99(baseline) + CPU_SHARE_SLACK_S, (_p99(loaded), _p99(baseline))
