"""The tokenizer pool's threads yield the CPU to everything else of the service,
and take jobs from the fair queue: a tenant flooding the pool with long
prompts holds up its own jobs, not another tenant's short one."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

import pytest

from gateway.tokenize_queue import TokenizeQueueLimits, TokenizerQueueFull
from gateway.tokenizer import ChatTokenizer
from gateway.tokenizer_pool import LARGE_JOB_CHARS, TOKENIZE_NICENESS, TokenizerPool
from gateway.validation import ModelLimits, ValidatedRequest
from shared.protocol import Generate

LIMITS = ModelLimits(context_tokens=1 << 20, vocab_size=100, max_tokens_limit=8)
LONG = "l" * LARGE_JOB_CHARS


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_tokenizer_threads_run_nicer_than_the_thread_that_made_the_pool() -> None:
    here = _niceness()
    pool = TokenizerPool(None, None, 2)  # type: ignore[arg-type]  # no tokenizing here
    try:
        there = {pool._executor.submit(_niceness).result() for _ in range(4)}
    finally:
        pool.close()
    assert there == {min(here + TOKENIZE_NICENESS, 19)}  # Linux caps niceness at 19
    assert _niceness() == here  # per thread: the event loop's is as it was


class GatedTokenizer:
    """Stands in for ChatTokenizer: ``encode`` notes each prompt as it starts
    and blocks until the test opens the gate of that prompt."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._gates: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def gate(self, prompt: str) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(prompt, threading.Event())

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._lock:
            self.started.append(text)
        assert self.gate(text).wait(timeout=10), f"gate of {text[:10]!r} never opened"
        return [1]


def _pool(
    tokenizer: GatedTokenizer, num_threads: int, limits: TokenizeQueueLimits | None = None
) -> TokenizerPool:
    return TokenizerPool(tokenizer, LIMITS, num_threads, limits)  # type: ignore[arg-type]


async def _job(pool: TokenizerPool, tenant: str, prompt: str) -> ValidatedRequest:
    generate = Generate(id=prompt[:8], prompt=prompt, max_tokens=1)
    return await pool.tokenize(generate, tenant, len(prompt))


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.005)


def test_a_short_prompt_waits_for_no_long_one_of_another_tenant() -> None:
    tokenizer = GatedTokenizer()

    async def scenario() -> None:
        pool = _pool(tokenizer, 2)
        try:
            async with asyncio.TaskGroup() as tasks:
                flood = [
                    tasks.create_task(_job(pool, "bob", f"{index}{LONG}")) for index in range(6)
                ]
                # Long prompts take all threads but one.
                await _until(lambda: len(tokenizer.started) == 1)
                await asyncio.sleep(0.05)
                assert len(tokenizer.started) == 1
                carol = tasks.create_task(_job(pool, "carol", "hello"))
                tokenizer.gate("hello").set()
                await carol
                assert tokenizer.started[1] == "hello"
                for index in range(6):
                    tokenizer.gate(f"{index}{LONG}").set()
                await asyncio.gather(*flood)
            assert pool.queue.num_jobs == 0
        finally:
            pool.close()

    asyncio.run(scenario())


def test_the_next_thread_goes_to_the_tenant_served_least() -> None:
    tokenizer = GatedTokenizer()

    async def scenario() -> None:
        pool = _pool(tokenizer, 1)
        try:
            async with asyncio.TaskGroup() as tasks:
                bob = [tasks.create_task(_job(pool, "bob", f"bob{index}")) for index in range(4)]
                await _until(lambda: tokenizer.started == ["bob0"])
                carol = tasks.create_task(_job(pool, "carol", "carol0"))
                await asyncio.sleep(0)  # carol's job is queued
                for prompt in ("bob0", "carol0", "bob1", "bob2", "bob3"):
                    tokenizer.gate(prompt).set()
                await asyncio.gather(*bob, carol)
            assert tokenizer.started == ["bob0", "carol0", "bob1", "bob2", "bob3"]
        finally:
            pool.close()

    asyncio.run(scenario())


def test_a_tenant_over_its_share_gets_queue_full_and_another_does_not() -> None:
    tokenizer = GatedTokenizer()
    share = TokenizeQueueLimits(max_chars_per_tenant=2 * len(LONG) + 2)

    async def scenario() -> None:
        pool = _pool(tokenizer, 1, share)
        try:
            async with asyncio.TaskGroup() as tasks:
                held = [tasks.create_task(_job(pool, "bob", f"{i}{LONG}")) for i in range(2)]
                await _until(lambda: len(tokenizer.started) == 1)
                with pytest.raises(TokenizerQueueFull, match="tenant 'bob'"):
                    await _job(pool, "bob", f"2{LONG}")
                carol = tasks.create_task(_job(pool, "carol", f"c{LONG}"))
                for prompt in (f"0{LONG}", f"1{LONG}", f"c{LONG}"):
                    tokenizer.gate(prompt).set()
                await asyncio.gather(*held, carol)
        finally:
            pool.close()

    asyncio.run(scenario())


def test_a_job_given_up_while_waiting_frees_its_place() -> None:
    tokenizer = GatedTokenizer()

    async def scenario() -> None:
        pool = _pool(tokenizer, 1)
        try:
            async with asyncio.TaskGroup() as tasks:
                running = tasks.create_task(_job(pool, "bob", "bob0"))
                await _until(lambda: tokenizer.started == ["bob0"])
                waiting = tasks.create_task(_job(pool, "bob", "bob1"))
                await _until(lambda: pool.queue.num_waiting == 1)
                waiting.cancel()
                await _until(lambda: pool.queue.num_waiting == 0)
                assert pool.queue.chars_of("bob") == len("bob0")
                tokenizer.gate("bob0").set()
                await running
            await _until(lambda: pool.queue.num_jobs == 0)
            assert tokenizer.started == ["bob0"]
        finally:
            pool.close()

    asyncio.run(scenario())


def test_the_pool_tokenizes_with_the_real_tokenizer(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario() -> list[ValidatedRequest]:
        pool = TokenizerPool(chat_tokenizer, model_limits, 2)
        try:
            return await asyncio.gather(
                *(
                    pool.tokenize(Generate(id=str(i), prompt="Hello world", max_tokens=4), "t", 11)
                    for i in range(8)
                )
            )
        finally:
            pool.close()

    results = asyncio.run(scenario())
    assert {tuple(result.prompt_ids) for result in results} == {
        tuple(chat_tokenizer.encode("Hello world", add_special_tokens=True))
    }
