"""A tenant's refusals are paced by the characters of the refused prompts:
the first is answered at once, the next wait for the ones before; another
tenant waits for none of them; a short prompt's refusal costs next to nothing.
The core holds the answer back with a ``Wait`` action."""

from __future__ import annotations

import msgspec
import pytest

from gateway.actions import SendFrame, Tokenize, Wait
from gateway.refusal import Refused
from gateway.refusal_pacer import RefusalPacer
from gateway.session import GatewaySession, SessionConfig
from gateway.tenants import Tenant
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.protocol import Error
from tests.gateway.test_session import FakeClock


def test_refusals_wait_for_the_characters_refused_before_them() -> None:
    pacer = RefusalPacer(max_chars_per_s=1_000_000)
    delays_s = [pacer.delay_s("bob", 100_000, now_s=10.0) for _ in range(3)]
    assert delays_s == pytest.approx([0.0, 0.1, 0.2])
    assert pacer.delay_s("carol", 100_000, now_s=10.0) == 0.0
    assert pacer.delay_s("bob", 10, now_s=10.25) == pytest.approx(0.05)
    # Once what bob had refused is paid for, a refusal is answered at once.
    assert pacer.delay_s("bob", 100_000, now_s=11.0) == 0.0


def _generate(client_id: str, prompt: str) -> str:
    frame = {"type": "generate", "id": client_id, "prompt": prompt, "max_tokens": 8}
    return msgspec.json.encode(frame).decode()


def test_the_core_holds_back_a_tenants_repeated_refusals(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    clock = FakeClock()
    config = SessionConfig(gateway_id="gw", max_refused_chars_per_s=1_000_000)
    session = GatewaySession(config, chat_tokenizer, model_limits, clock)
    bob = session.connect(Tenant(name="bob", tokens_per_minute=1_000), key_hash="b" * 64)
    carol = session.connect(Tenant(name="carol"), key_hash="c" * 64)
    # Over bob's tokens per minute from its bytes alone: refused at once...
    words = "word " * 20_000
    first = session.on_frame(bob, _generate("a", words))
    assert [type(action) for action in first] == [SendFrame]
    # ...and the next one after the first is paid for (0.1 s at 1,000,000 a second).
    second = session.on_frame(bob, _generate("b", words))
    assert isinstance(second[0], Wait) and second[0].duration_s == pytest.approx(0.1)
    assert isinstance(second[1], SendFrame) and isinstance(second[1].frame, Error)
    # A short prompt's refusal, or another tenant's, is not held back for it.
    clock.now_s += 0.2
    [short] = session.on_frame(bob, _generate("c", "1" * 2_000))
    assert isinstance(short, SendFrame) and isinstance(short.frame, Error)
    [job] = session.on_frame(carol, _generate("d", words))
    assert isinstance(job, Tokenize)
    # A refusal after tokenizing (the queue full, or the prompt too long) is paced alike.
    session.on_tokenize_failed(job.request_id, Refused("queue_full", "full"), num_chars=100_000)
    [job] = session.on_frame(carol, _generate("d", words))
    assert isinstance(job, Tokenize)
    full = Refused("queue_full", "full")
    held = session.on_tokenize_failed(job.request_id, full, num_chars=100_000)
    assert isinstance(held[0], Wait) and held[0].duration_s == pytest.approx(0.1)
    # The gateway's own failure is never held back.
    [job] = session.on_frame(carol, _generate("e", words))
    assert isinstance(job, Tokenize)
    internal_error = Refused("internal", "x")
    [internal] = session.on_tokenize_failed(job.request_id, internal_error, num_chars=100_000)
    assert isinstance(internal, SendFrame)
