"""The extreme sampling values validation admits, sent through the public
websocket at once beside a normal client: each request ends normally, the
worker (and every other process) is the same process afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.adversarial.service import Client, Service, open_socket

VOCAB_SIZE = 49152  # SmolLM2's embedding rows
SMALLEST_SUBNORMAL = 5e-324
SMALLEST_NORMAL_FP64 = 2.2250738585072014e-308
SMALLEST_NORMAL_FP32 = 1.1754943508222875e-38
LARGEST_SEED = 2**63 - 1
ROUND = 8

EXTREMES: list[dict[str, Any]] = [
    {"temperature": SMALLEST_SUBNORMAL},
    {"temperature": SMALLEST_NORMAL_FP64},
    {"temperature": 1e-45},
    {"temperature": SMALLEST_NORMAL_FP32},
    {"temperature": 1e-5},
    {"temperature": 100.0},
    {"temperature": -0.0},
    {"temperature": 1.0, "top_p": SMALLEST_SUBNORMAL},
    {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": 1.0, "top_p": 1.0},
    {"temperature": 1.0, "top_k": LARGEST_SEED},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.0, "top_k": VOCAB_SIZE},
    {"temperature": 1.0, "seed": LARGEST_SEED},
    {"temperature": 1.0, "seed": 0},
    {"max_tokens": 1},
    {"temperature": 100.0, "top_p": SMALLEST_SUBNORMAL, "top_k": 1, "seed": LARGEST_SEED},
    {"temperature": SMALLEST_SUBNORMAL, "top_p": SMALLEST_SUBNORMAL, "ignore_eos": True},
    {"prompt_token_ids": [0, VOCAB_SIZE - 1, 1, 2]},
]


async def _victim(service: Service) -> None:
    async with open_socket(service, "victim") as socket:
        outcome = await Client(socket).ask("v", max_tokens=16)
        assert outcome.end is not None and outcome.end["type"] == "done", outcome.frames
        assert [t["seq"] for t in outcome.tokens] == list(range(len(outcome.tokens)))


def test_extreme_sampling_values_end_normally(service: Service) -> None:
    async def attack() -> None:
        async with open_socket(service, "attacker") as socket:
            client = Client(socket)
            # In rounds within the attacker's max_queued of 16.
            for start in range(0, len(EXTREMES), ROUND):
                extremes = list(enumerate(EXTREMES))[start : start + ROUND]
                for i, fields in extremes:
                    await client.generate(f"x{i}", **{"max_tokens": 6, **fields})
                for i, fields in extremes:
                    outcome = await client.until_end(f"x{i}")
                    assert outcome.end is not None
                    assert outcome.end["type"] == "done", (fields, outcome.frames)
                    assert outcome.end["finish_reason"] in ("length", "stop"), outcome.end
                    assert all(0 <= t["token_id"] < VOCAB_SIZE for t in outcome.tokens)

    async def both() -> None:
        await asyncio.gather(attack(), _victim(service))

    asyncio.run(both())


def test_the_same_seed_gives_the_same_tokens_at_the_edges(service: Service) -> None:
    fields = {"temperature": 100.0, "top_k": LARGEST_SEED, "seed": LARGEST_SEED, "max_tokens": 6}

    async def twice() -> list[list[int]]:
        async with open_socket(service, "victim") as socket:
            client = Client(socket)
            runs = []
            for name in ("a", "b"):
                outcome = await client.ask(name, **fields)
                runs.append([t["token_id"] for t in outcome.tokens])
            return runs

    first, second = asyncio.run(twice())
    assert first == second and len(first) == 6
