"""Frames a hostile client sends: each gets an ``error`` with a code and a plain
message (no internals), the socket keeps working, and nothing else is hurt."""

from __future__ import annotations

import asyncio
import json
import time

from tests.adversarial.service import INTERNALS, Client, Service, open_socket

VOCAB_SIZE = 49152
SAY = [{"role": "user", "content": "hi"}]


def _generate(client_id: str, **fields: object) -> str:
    return json.dumps({"type": "generate", "id": client_id, **fields})


BAD_FRAMES: dict[str, str] = {
    "overflowing temperature": '{"type":"generate","id":"b","prompt":"x","temperature":1e999}',
    "NaN temperature": '{"type":"generate","id":"b","prompt":"x","temperature":NaN}',
    "Infinity top_p": '{"type":"generate","id":"b","prompt":"x","top_p":Infinity}',
    "negative temperature": _generate("b", prompt="x", temperature=-1e-300),
    "temperature over the range": _generate("b", prompt="x", temperature=100.00001),
    "zero top_p": _generate("b", prompt="x", top_p=0.0),
    "top_p over one": _generate("b", prompt="x", top_p=1.0000001),
    "negative top_k": _generate("b", prompt="x", top_k=-1),
    "top_k past int64": _generate("b", prompt="x", top_k=2**64),
    "seed past int64": _generate("b", prompt="x", seed=2**63),
    "zero max_tokens": _generate("b", prompt="x", max_tokens=0),
    "huge max_tokens": _generate("b", prompt="x", max_tokens=10**12),
    "token id at the vocabulary size": _generate("b", prompt_token_ids=[VOCAB_SIZE]),
    "token id past int64": _generate("b", prompt_token_ids=[2**64]),
    "negative token id": _generate("b", prompt_token_ids=[-1]),
    "too many stop strings": _generate("b", prompt="x", stop=[f"s{i}" for i in range(17)]),
    "a stop string too long": _generate("b", prompt="x", stop=["s" * 257]),
    "too many messages": _generate("b", messages=SAY * 513),
    "a role outside the allowlist": _generate("b", messages=[{"role": "root", "content": "x"}]),
    "a prompt over the character cap": _generate("b", prompt="x" * 100_001),
    "messages over the character cap": _generate(
        "b", messages=[{"role": "user", "content": "x" * 50_001}] * 2
    ),
    "two prompt forms": _generate("b", prompt="x", messages=SAY),
    "no prompt": _generate("b"),
    "an empty prompt": _generate("b", prompt=""),
    "unknown field": _generate("b", prompt="x", logit_bias={"1": 100}),
    "unknown type": '{"type":"shutdown"}',
    "not JSON": "{this is not json",
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "a cancel of nothing": '{"type":"cancel","id":"nothing"}',
    "a resume of nothing": '{"type":"resume","request_id":"0123456789abcdef"}',
}


def test_every_bad_frame_gets_a_clear_error_and_the_socket_goes_on(service: Service) -> None:
    async def attack() -> dict[str, dict[str, object]]:
        answers = {}
        async with open_socket(service, "attacker") as socket:
            for name, frame in BAD_FRAMES.items():
                await socket.send(frame)
                answers[name] = json.loads(await asyncio.wait_for(socket.recv(), 30))
            await socket.send(b"\x00binary")
            answers["a binary frame"] = json.loads(await asyncio.wait_for(socket.recv(), 30))
            outcome = await Client(socket).ask("after", max_tokens=4)
            assert outcome.end is not None and outcome.end["type"] == "done", outcome.frames
        return answers

    answers = asyncio.run(attack())
    for name, answer in answers.items():
        assert answer["type"] == "error", (name, answer)
        assert answer["code"] in ("invalid_request", "prompt_too_long"), (name, answer)
        message = str(answer["message"])
        assert message and not INTERNALS.search(message), (name, message)


def test_a_prompt_at_the_character_cap_is_refused_quickly_not_tokenized_forever(
    service: Service,
) -> None:
    async def probe() -> tuple[float, dict[str, object]]:
        async with open_socket(service, "attacker") as socket:
            started = time.monotonic()
            await socket.send(_generate("big", prompt="word " * 20_000))
            answer = json.loads(await asyncio.wait_for(socket.recv(), 30))
            return time.monotonic() - started, answer

    elapsed_s, answer = asyncio.run(probe())
    # 100,000 characters are ~20,000 tokens: over SmolLM2's context of 8,192.
    assert answer["type"] == "error" and answer["code"] == "prompt_too_long", answer
    assert elapsed_s < 5.0
