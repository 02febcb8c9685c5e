"""Admission and the request table in the pure core: requests being tokenized
hold their id, a tenant's cap counts its detached requests, the tokenizer's
queue gets each job with its tenant and cost, a prompt certainly over the
context or its tenant's tokens per minute is refused before tokenizing, a
stalled request ends, tenants get a default max_queued."""

from __future__ import annotations

import msgspec
import pytest

from gateway.actions import Action, PostUpstream, SendFrame, Tokenize
from gateway.admission import AdmissionLimits
from gateway.session import GatewaySession, SessionConfig
from gateway.tenants import Tenant
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits, tokenize_generate
from shared.messages import CancelRequest, RequestEnded, SubmitRequest, TokenBatch, encode
from shared.protocol import Accepted, Done, Error, Token
from tests.gateway.session_driver import InlineTokenizingSession
from tests.gateway.test_session import FakeClock
from tests.gateway.worker_tokens import worker_tokens


def frames(actions: list[Action]) -> list[object]:
    return [action.frame for action in actions if isinstance(action, SendFrame)]


def generate_frame(client_id: str, **fields: object) -> str:
    body = {"type": "generate", "id": client_id, "prompt": "Hello", "max_tokens": 8, **fields}
    return msgspec.json.encode(body).decode()


def tokenized(
    session: GatewaySession, job: Tokenize, tokenizer: ChatTokenizer, limits: ModelLimits
) -> list[Action]:
    validated = tokenize_generate(job.generate, tokenizer, limits)
    return session.on_tokenized(job.request_id, job.generate, validated)


def test_a_cancel_or_close_while_tokenizing_drops_the_request(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    session = GatewaySession(
        SessionConfig(gateway_id="gw"), chat_tokenizer, model_limits, clock=lambda: 0.0
    )
    socket_id = session.connect()
    [job] = session.on_frame(socket_id, generate_frame("a"))
    assert isinstance(job, Tokenize)
    # The id is held meanwhile: a second generate with it is a duplicate.
    [duplicate] = frames(session.on_frame(socket_id, generate_frame("a")))
    assert isinstance(duplicate, Error) and duplicate.code == "invalid_request"
    [done] = frames(session.on_frame(socket_id, '{"type":"cancel","id":"a"}'))
    assert isinstance(done, Done) and (done.id, done.finish_reason) == ("a", "cancelled")
    # The tokenizer's answer finds nobody: nothing is accepted or submitted.
    assert tokenized(session, job, chat_tokenizer, model_limits) == []
    [job] = session.on_frame(socket_id, generate_frame("b"))
    assert isinstance(job, Tokenize)
    assert session.disconnect(socket_id) == []
    assert tokenized(session, job, chat_tokenizer, model_limits) == []
    assert session.table.num_pending == 0 and session.table.num_live_of_tenant("default") == 0


def test_a_generate_is_tokenized_in_its_tenants_queue_at_its_cost(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    session = GatewaySession(
        SessionConfig(gateway_id="gw"), chat_tokenizer, model_limits, clock=lambda: 0.0
    )
    tenant = Tenant(name="t", weight=2.0, max_tokens_per_request=50)
    socket_id = session.connect(tenant, key_hash="k" * 64)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    [job] = session.on_frame(socket_id, generate_frame("a", prompt=None, messages=messages))
    assert isinstance(job, Tokenize)
    assert (job.tenant, job.num_chars, job.max_tokens_cap) == (tenant, 11, 50)


def test_a_prompt_certainly_over_the_context_is_refused_before_tokenizing(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    session = GatewaySession(
        SessionConfig(gateway_id="gw"), chat_tokenizer, model_limits, clock=lambda: 0.0
    )
    socket_id = session.connect()
    # Every digit is a token of its own: at least 9,000 tokens, over 8,192.
    digits = "1234567890" * 900
    assert len(chat_tokenizer.encode(digits, add_special_tokens=True)) >= 9_000
    for fields in (
        {"prompt": digits},
        {"prompt": None, "messages": [{"role": "user", "content": digits}]},
    ):
        [refused] = frames(session.on_frame(socket_id, generate_frame("a", **fields)))
        assert isinstance(refused, Error) and refused.code == "prompt_too_long", refused
        assert "at least 9000 tokens" in refused.message
    # Just as long but cheap in tokens (runs of spaces): tokenized, not refused here.
    [job] = session.on_frame(socket_id, generate_frame("b", prompt=" " * 9_000))
    assert isinstance(job, Tokenize)
    assert session.table.num_pending == 1


def test_a_prompt_certainly_over_the_tokens_per_minute_is_refused_before_tokenizing(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    session = GatewaySession(
        SessionConfig(gateway_id="gw"), chat_tokenizer, model_limits, clock=lambda: 0.0
    )
    socket_id = session.connect(Tenant(name="bob", tokens_per_minute=3000), key_hash="k" * 64)
    prose = ("the quick brown fox jumps over the lazy dog " * 2300)[:100_000]
    [refused] = frames(session.on_frame(socket_id, generate_frame("a", prompt=prose)))
    assert isinstance(refused, Error) and refused.code == "invalid_request", refused
    assert "at least" in refused.message and "tokens-per-minute limit of 3000" in refused.message
    assert session.table.num_pending == 0
    # At least 2,403 tokens: under 3,000 with max_tokens 8, over it with a null
    # max_tokens (which takes what the context leaves, up to the cap of 1,000).
    part = prose[:60_000]
    [refused] = frames(
        session.on_frame(socket_id, generate_frame("b", prompt=part, max_tokens=None))
    )
    assert isinstance(refused, Error) and refused.code == "invalid_request", refused
    assert "at least 3403 tokens" in refused.message
    [job] = session.on_frame(socket_id, generate_frame("c", prompt=part))
    assert isinstance(job, Tokenize)


def test_a_tenants_cap_counts_its_detached_requests(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    config = SessionConfig(
        gateway_id="gw", detach_grace_s=30.0, admission=AdmissionLimits(max_requests_per_tenant=2)
    )
    session = InlineTokenizingSession(config, chat_tokenizer, model_limits, FakeClock())
    tenant = Tenant(name="t")
    dropped = session.connect(tenant, key_hash="k" * 64)
    for client_id in ("a", "b"):
        assert isinstance(frames(session.on_frame(dropped, generate_frame(client_id)))[0], Accepted)
    assert session.disconnect(dropped) == []  # detached, still running
    fresh = session.connect(tenant, key_hash="k" * 64)
    [refused] = frames(session.on_frame(fresh, generate_frame("c")))
    assert isinstance(refused, Error) and refused.code == "queue_full"
    assert "tenant 't' already has 2 requests" in refused.message
    # Another tenant is not held back by it.
    other = session.connect(Tenant(name="u"), key_hash="u" * 64)
    assert isinstance(frames(session.on_frame(other, generate_frame("c")))[0], Accepted)


def test_a_request_without_progress_ends_in_an_error_and_a_cancel(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    clock = FakeClock()
    config = SessionConfig(gateway_id="gw", stall_timeout_s=10.0)
    session = InlineTokenizingSession(config, chat_tokenizer, model_limits, clock)
    socket_id = session.connect()
    [accepted] = frames(session.on_frame(socket_id, generate_frame("a")))
    assert isinstance(accepted, Accepted)
    request_id = accepted.request_id
    tokens = worker_tokens(chat_tokenizer, request_id, "one two three")
    clock.now_s += 9
    batch = encode(TokenBatch(worker_id="w", tokens=tokens[:1]))
    assert isinstance(frames(session.on_gateway_message(batch, "ch"))[0], Token)
    clock.now_s += 9  # 18 s since acceptance, 9 since the last token
    assert session.on_tick() == []
    clock.now_s += 1.5
    actions = session.on_tick()
    [error] = frames(actions)
    assert error == Error(code="internal", message="the request made no progress for 10 s", id="a")
    [cancel] = [a for a in actions if isinstance(a, PostUpstream)]
    assert cancel.message == CancelRequest(request_id=request_id)
    assert cancel.log_entry == RequestEnded(request_id=request_id, num_tokens=1)
    assert session.on_tick() == []
    assert session.live_request_ids(socket_id) == []


@pytest.mark.parametrize(("max_queued", "expected"), [(None, 256), (5, 5)])
def test_a_tenant_without_max_queued_gets_the_default(
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    max_queued: int | None,
    expected: int,
) -> None:
    session = InlineTokenizingSession(
        SessionConfig(gateway_id="gw"), chat_tokenizer, model_limits, FakeClock()
    )
    socket_id = session.connect(Tenant(name="t", max_queued=max_queued), key_hash="k" * 64)
    submits = [
        action.message
        for action in session.on_frame(socket_id, generate_frame("a"))
        if isinstance(action, PostUpstream)
    ]
    [submit] = submits
    assert isinstance(submit, SubmitRequest) and submit.limits.max_queued == expected


def test_a_null_max_tokens_is_settled_before_it_is_reserved_and_submitted(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    session = InlineTokenizingSession(
        SessionConfig(gateway_id="gw"), chat_tokenizer, model_limits, FakeClock()
    )
    tenant = Tenant(name="t", tokens_per_minute=100_000)
    socket_id = session.connect(tenant, key_hash="k" * 64)
    frame = generate_frame("a", max_tokens=None, min_tokens=3)
    [post] = [a for a in session.on_frame(socket_id, frame) if isinstance(a, PostUpstream)]
    submit = post.message
    assert isinstance(submit, SubmitRequest)
    num_prompt_tokens = len(submit.prompt_ids)
    # The context leaves more than the gateway's cap beside "Hello": the cap.
    assert submit.sampling.max_tokens == model_limits.max_tokens_limit
    assert submit.sampling.min_tokens == 3
    assert post.reservation is not None
    assert post.reservation.num_tokens == num_prompt_tokens + model_limits.max_tokens_limit
    # A tenant's max_tokens cap holds min_tokens too (a null max_tokens comes to at least it).
    capped = session.connect(Tenant(name="u", max_tokens_per_request=500), key_hash="u" * 64)
    frame = generate_frame("b", max_tokens=None, min_tokens=501)
    [refused] = frames(session.on_frame(capped, frame))
    assert isinstance(refused, Error) and refused.code == "invalid_request"
    assert "min_tokens 501" in refused.message and "500" in refused.message
    # ...and a null max_tokens resolves to no more than the tenant's cap.
    frame = generate_frame("c", max_tokens=None)
    [post] = [a for a in session.on_frame(capped, frame) if isinstance(a, PostUpstream)]
    assert isinstance(post.message, SubmitRequest)
    assert post.message.sampling.max_tokens == 500
