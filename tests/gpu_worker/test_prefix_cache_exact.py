"""Prefix caching is exact: the scheduler core driving the real SmolLM2 engine
(fp32, CPU) through staggered multi-turn chats that share a system prompt,
with the cache on and off, gives the same greedy answers token for token,
while the cache skips most of the prefill."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gateway.tokenizer import ChatTokenizer
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
from gpu_worker.model_loading import load_model
from scheduler_actor.config import SchedulerConfig
from scheduler_actor.core import Scheduler
from shared.messages import SamplingParams

SYSTEM = (
    "You are a patient assistant for a small bakery. Answer briefly, in plain words, "
    "and always mention one kind of bread."
)
QUESTIONS = [
    ["What do you sell?", "Which one is best for toast?", "How long does it keep?"],
    ["Hello!", "Do you bake on Sundays?", "What time do you open?"],
]
MAX_TOKENS = 6
BLOCK_SIZE = 16
NUM_BLOCKS = 160


@dataclass
class Chat:
    index: int
    start_step: int
    answers: list[list[int]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def smollm2(prepared_model_dir):
    tokenizer = ChatTokenizer.from_model_dir(prepared_model_dir)
    model = load_model(prepared_model_dir, device="cpu", dtype="float32")
    return tokenizer, model


def _prompt(tokenizer: ChatTokenizer, chat: Chat) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, answer in enumerate(chat.answers):
        messages.append({"role": "user", "content": QUESTIONS[chat.index][turn]})
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
    messages.append({"role": "user", "content": QUESTIONS[chat.index][len(chat.answers)]})
    return tokenizer.encode_chat(messages)


def _run_chats(tokenizer: ChatTokenizer, model, prefix_caching: bool) -> tuple[list[Chat], int]:
    """Every chat's turns, each submitted when the previous answer is back;
    returns the chats and the prompt tokens the engine computed."""
    budget = KVCacheBudget(
        num_bytes=NUM_BLOCKS * bytes_per_block(model.config, BLOCK_SIZE, model.dtype),
        block_size=BLOCK_SIZE,
    )
    engine = Engine(model, budget, "cpu", worker_id="w")
    config = SchedulerConfig(
        max_batch_size=8, token_budget=96, max_chunk_tokens=64, prefix_caching=prefix_caching
    )
    scheduler = Scheduler(config, lambda: 0.0)
    scheduler.worker_joined("w", engine.num_blocks, engine.block_size, 2)
    chats = [Chat(index, start_step=3 * index) for index in range(len(QUESTIONS))]
    running: dict[str, Chat] = {}
    pending = []
    num_prefill_tokens = 0
    for step in range(2000):
        for chat in chats:
            turn = len(chat.answers)
            request_id = f"c{chat.index}t{turn}"
            if (
                step >= chat.start_step
                and turn < len(QUESTIONS[chat.index])
                and chat not in running.values()
            ):
                prompt = _prompt(tokenizer, chat)
                chat.prompt_lengths.append(len(prompt))
                sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
                scheduler.submit(request_id, "bakery", prompt, sampling)
                running[request_id] = chat
        plan = scheduler.next_plan("w")
        if plan is not None:
            for spec in plan.new_requests:
                running[spec.request_id].cached.append(spec.num_cached_tokens)
            num_prefill_tokens += sum(len(chunk.token_ids) for chunk in plan.prefill_chunks)
            pending.append(engine.step(plan))
        if pending and (plan is None or len(pending) >= 2):
            for finished in scheduler.on_result(pending.pop(0)):
                chat = running.pop(finished.request_id)
                assert finished.finish_reason in ("stop", "length"), finished
                chat.answers.append(finished.token_ids)
        if all(len(c.answers) == len(QUESTIONS[c.index]) for c in chats):
            assert engine.active_request_ids == []
            return chats, num_prefill_tokens
    raise AssertionError("the chats did not finish")


def test_greedy_answers_with_the_cache_equal_those_without(smollm2) -> None:
    tokenizer, model = smollm2
    cached_chats, cached_prefill = _run_chats(tokenizer, model, prefix_caching=True)
    plain_chats, plain_prefill = _run_chats(tokenizer, model, prefix_caching=False)
    for with_cache, without in zip(cached_chats, plain_chats, strict=True):
        assert with_cache.answers == without.answers, with_cache.index
        assert with_cache.prompt_lengths == without.prompt_lengths
        assert all(num == 0 for num in without.cached)
        # Every later turn starts after the history it shares with the turn before.
        assert all(num >= BLOCK_SIZE * 2 for num in with_cache.cached[1:]), with_cache.cached
    # The chats after the first hit the system prompt the first one cached.
    assert all(chat.cached[0] > 0 for chat in cached_chats[1:])
    assert cached_prefill * 2 < plain_prefill, (cached_prefill, plain_prefill)
