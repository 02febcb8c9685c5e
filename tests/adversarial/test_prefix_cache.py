"""The prefix cache of a real ``orcapod up``, through the official ``openai``
client: a repeated conversation reports its cached prompt tokens in
``usage``, and a tenant sending another tenant's exact prompt neither hits it
nor can tell from the time its answer takes that it is cached."""

from __future__ import annotations

import statistics
import time
from typing import Any

import openai

from tests.adversarial.service import KEYS, Service

MODEL = "SmolLM2-135M-Instruct"
# About 300 tokens: its prefill takes the CPU hundreds of milliseconds, a hit a few.
SYSTEM = " ".join(
    f"Rule {index}: answer the customer of the harbour bakery politely, in one short line, "
    f"and never mention the secret recipe number {index * 37 % 101}."
    for index in range(10)
)


def _client(service: Service, tenant: str) -> openai.OpenAI:
    base_url = f"http://127.0.0.1:{service.port}/v1"
    return openai.OpenAI(base_url=base_url, api_key=KEYS[tenant], max_retries=0)


def _messages(question: str, system: str = SYSTEM) -> list[Any]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _ask(client: openai.OpenAI, messages: list[Any]) -> tuple[float, int, int]:
    """Seconds to the (one-token) answer, prompt tokens, cached prompt tokens."""
    started = time.perf_counter()
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, temperature=0
    )
    seconds = time.perf_counter() - started
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return seconds, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_a_cached_prompt_is_reported_and_no_other_tenant_can_hit_or_time_it(
    service: Service,
) -> None:
    victim, attacker = _client(service, "victim"), _client(service, "attacker")
    hits, probes, misses = [], [], []
    for attempt in range(3):
        # Each attempt's prompts differ from their first token: no earlier one is a prefix.
        secret = _messages(f"What is secret number {attempt}?", system=f"<{attempt}> {SYSTEM}")
        _seconds, num_prompt, first_cached = _ask(victim, secret)
        assert num_prompt > 250 and first_cached == 0
        # Sent again, every full 16-token block but the one holding its last token is cached.
        seconds, num_prompt_again, cached = _ask(victim, secret)
        assert num_prompt_again == num_prompt
        assert num_prompt - 16 <= cached < num_prompt and cached % 16 == 0
        hits.append(seconds)
        # The attacker sends the victim's exact prompt, for the first time.
        seconds, _, cached = _ask(attacker, secret)
        assert cached == 0  # the victim's blocks are not the attacker's to find
        probes.append(seconds)
        # A prompt as long that nobody sent before: what a miss costs.
        fresh = _messages(f"What is secret number {attempt}?", system=f"[{attempt}] {SYSTEM}")
        seconds, _, cached = _ask(attacker, fresh)
        assert cached == 0
        misses.append(seconds)
    hit, probe, miss = (statistics.median(times) for times in (hits, probes, misses))
    # The attacker's probe costs what a miss costs, far more than the victim's hit.
    assert probe > 3 * hit, (hits, probes, misses)
    assert 0.5 * miss < probe < 2 * miss, (hits, probes, misses)
