"""The pure gateway core: frames and token batches in, frames and upstream messages out."""

from __future__ import annotations

import msgspec
import pytest

from gateway.actions import Action, DeadLetter, LoadLog, PostUpstream, SendFrame
from gateway.admission import AdmissionLimits
from gateway.session import GatewaySession, SessionConfig
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.messages import (
    CancelRequest,
    RequestFailed,
    RequestRecord,
    RequestRejected,
    SampledToken,
    SamplingParams,
    SubmitRequest,
    TokenBatch,
    encode,
)
from shared.protocol import Accepted, Done, Error, Generate, Token
from shared.request_log import RequestLog
from tests.gateway.session_driver import InlineTokenizingSession
from tests.gateway.worker_tokens import worker_tokens


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def session(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits, clock: FakeClock
) -> GatewaySession:
    return InlineTokenizingSession(
        SessionConfig(
            gateway_id="gw",
            max_frame_bytes=4096,
            admission=AdmissionLimits(max_requests_per_socket=2),
        ),
        chat_tokenizer,
        model_limits,
        clock,
    )


def frames(actions: list[Action]) -> list[object]:
    return [action.frame for action in actions if isinstance(action, SendFrame)]


def upstream(actions: list[Action]) -> list[object]:
    return [action.message for action in actions if isinstance(action, PostUpstream)]


def generate(session: GatewaySession, socket_id: int, client_id: str, **fields: object) -> str:
    body = {"type": "generate", "id": client_id, "prompt": "Hello", **fields}
    actions = session.on_frame(socket_id, msgspec.json.encode(body).decode())
    accepted = frames(actions)[0]
    assert isinstance(accepted, Accepted), accepted
    return accepted.request_id


def batch(*tokens: SampledToken) -> bytes:
    return encode(TokenBatch(worker_id="w", tokens=list(tokens)))


def test_generate_submits_the_tokenized_prompt(
    session: GatewaySession, chat_tokenizer: ChatTokenizer
) -> None:
    socket_id = session.connect()
    body = '{"type":"generate","id":"a","prompt":"Hello","max_tokens":7,"temperature":0,"seed":3}'
    actions = session.on_frame(socket_id, body)
    assert frames(actions) == [Accepted(id="a", request_id="r0")]
    [submit] = upstream(actions)
    assert isinstance(submit, SubmitRequest)
    assert submit.prompt_ids == chat_tokenizer.encode("Hello", add_special_tokens=True)
    assert (submit.gateway_id, submit.tenant) == ("gw", "default")
    assert submit.sampling.max_tokens == 7 and submit.sampling.seed == 3
    assert submit.sampling.stop_token_ids == ()


def test_chat_messages_use_the_template(
    session: GatewaySession, chat_tokenizer: ChatTokenizer
) -> None:
    socket_id = session.connect()
    body = '{"type":"generate","id":"a","messages":[{"role":"user","content":"Hi"}]}'
    [submit] = upstream(session.on_frame(socket_id, body))
    assert isinstance(submit, SubmitRequest)
    text = chat_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert submit.prompt_ids == chat_tokenizer.encode(text, add_special_tokens=False)


def test_tokens_in_order_exactly_once_with_timings(
    session: GatewaySession, chat_tokenizer: ChatTokenizer, clock: FakeClock
) -> None:
    socket_id = session.connect()
    request_id = generate(session, socket_id, "a")
    t0, t1, t2, t3, t4 = worker_tokens(chat_tokenizer, request_id, "🦩 flamingo")
    clock.now_s += 0.25
    # Ahead-of-order tokens wait for the missing one; duplicates are dropped.
    assert frames(session.on_gateway_message(batch(t1, t2), "ch")) == []
    first = frames(session.on_gateway_message(batch(t0, t1), "ch"))
    clock.now_s += 0.5
    rest = frames(session.on_gateway_message(batch(t2, t4, t3, t3), "ch"))
    sent = first + rest
    token_frames = [frame for frame in sent if isinstance(frame, Token)]
    assert [frame.seq for frame in token_frames] == [0, 1, 2, 3, 4]
    assert "".join(frame.text for frame in token_frames) == "🦩 flamingo"
    assert all("\ufffd" not in frame.text for frame in token_frames)
    done = sent[-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert done.usage.completion_tokens == 5
    assert done.timings.ttft_ms == pytest.approx(250.0)
    assert done.timings.total_ms == pytest.approx(750.0)
    # A late duplicate after the end changes nothing.
    assert session.on_gateway_message(batch(t4), "ch") == []


def test_stop_string_truncates_and_cancels_upstream(
    session: GatewaySession, chat_tokenizer: ChatTokenizer
) -> None:
    socket_id = session.connect()
    request_id = generate(session, socket_id, "a", stop=["END"])
    actions = session.on_gateway_message(
        batch(*worker_tokens(chat_tokenizer, request_id, "one two END three", finish=None)), "ch"
    )
    sent = frames(actions)
    assert "".join(frame.text for frame in sent if isinstance(frame, Token)) == "one two "
    assert isinstance(sent[-1], Done) and sent[-1].finish_reason == "stop"
    assert upstream(actions) == [CancelRequest(request_id=request_id)]


def test_cancel_ends_with_done_and_drops_later_tokens(
    session: GatewaySession, chat_tokenizer: ChatTokenizer
) -> None:
    socket_id = session.connect()
    request_id = generate(session, socket_id, "a")
    token0, token1 = worker_tokens(chat_tokenizer, request_id, "Hi there")
    session.on_gateway_message(batch(token0), "ch")
    actions = session.on_frame(socket_id, '{"type":"cancel","id":"a"}')
    assert upstream(actions) == [CancelRequest(request_id=request_id)]
    [done] = frames(actions)
    assert isinstance(done, Done) and done.finish_reason == "cancelled"
    assert done.usage.completion_tokens == 1
    assert session.on_gateway_message(batch(token1), "ch") == []
    # The id is free again once the request ended.
    generate(session, socket_id, "a")


def test_disconnect_cancels_and_resume_replays_the_end(
    session: GatewaySession, chat_tokenizer: ChatTokenizer
) -> None:
    socket_id = session.connect()
    request_id = generate(session, socket_id, "a")
    session.on_gateway_message(
        batch(worker_tokens(chat_tokenizer, request_id, "Hi there")[0]), "ch"
    )
    assert upstream(session.disconnect(socket_id)) == [CancelRequest(request_id=request_id)]
    other = session.connect()
    replay = frames(session.on_frame(other, f'{{"type":"resume","request_id":"{request_id}"}}'))
    assert [type(frame) for frame in replay] == [Token, Done]
    assert all(frame.id == "a" for frame in replay)  # type: ignore[attr-defined]


def test_resume_moves_a_live_request_to_the_new_socket(
    session: GatewaySession, chat_tokenizer: ChatTokenizer
) -> None:
    old = session.connect()
    request_id = generate(session, old, "a")
    tokens = worker_tokens(chat_tokenizer, request_id, "one two three four")
    session.on_gateway_message(batch(*tokens[:2]), "ch")
    new = session.connect()
    resume = f'{{"type":"resume","request_id":"{request_id}","after_seq":0,"id":"b"}}'
    replay = [a for a in session.on_frame(new, resume) if isinstance(a, SendFrame)]
    assert [(a.socket_id, a.frame) for a in replay] == [
        (new, Token(id="b", seq=1, text=" two", token_id=tokens[1].token_id))
    ]
    rest = [a for a in session.on_gateway_message(batch(*tokens[2:]), "ch")]
    sends = [a for a in rest if isinstance(a, SendFrame)]
    assert {a.socket_id for a in sends} == {new}
    assert {a.frame.id for a in sends if isinstance(a.frame, Token | Done)} == {"b"}
    assert session.disconnect(old) == []


def test_finished_requests_are_forgotten_after_the_retention(
    session: GatewaySession, chat_tokenizer: ChatTokenizer, clock: FakeClock
) -> None:
    socket_id = session.connect()
    request_id = generate(session, socket_id, "a")
    session.on_gateway_message(batch(*worker_tokens(chat_tokenizer, request_id, "Hi")), "ch")
    assert session.stream(request_id) is not None
    clock.now_s += session.config.retention_s + 1
    resume = f'{{"type":"resume","request_id":"{request_id}"}}'
    # Not known here any more: the shell is asked for the request's log in Redis...
    [load] = session.on_frame(socket_id, resume)
    assert isinstance(load, LoadLog) and load.request_id == request_id
    assert session.stream(request_id) is None
    # ... and when that is gone too, the client is told.
    [error] = frames(session.on_log_loaded(socket_id, load.resume, None))
    assert isinstance(error, Error) and error.code == "invalid_request"


def test_rejected_request_becomes_an_error_with_a_known_code(session: GatewaySession) -> None:
    socket_id = session.connect()
    first = generate(session, socket_id, "a")
    second = generate(session, socket_id, "b")
    rejected = RequestRejected(request_id=first, code="queue_full", message="busy")
    [error] = frames(session.on_gateway_message(encode(rejected), "ch"))
    assert error == Error(code="queue_full", message="busy", id="a")
    odd = RequestRejected(request_id=second, code="something_new", message="?")
    [error] = frames(session.on_gateway_message(encode(odd), "ch"))
    assert isinstance(error, Error) and error.code == "internal" and error.id == "b"
    assert session.live_request_ids(socket_id) == []


def test_failed_submit_ends_the_request(session: GatewaySession) -> None:
    socket_id = session.connect()
    request_id = generate(session, socket_id, "a")
    [error] = frames(session.on_submit_refused(request_id, "internal", "could not queue"))
    assert isinstance(error, Error) and error.code == "internal" and error.id == "a"
    assert session.stream(request_id) is None


def test_undecodable_gateway_message_is_a_dead_letter(session: GatewaySession) -> None:
    [action] = session.on_gateway_message(b"\xc1 not msgpack", "tokens:gw")
    assert isinstance(action, DeadLetter)
    assert action.source == "tokens:gw" and action.data == b"\xc1 not msgpack"


@pytest.mark.parametrize(
    ("frame", "code", "client_id"),
    [
        (b'{"type":"cancel","id":"a"}', "invalid_request", None),
        ("{not json", "invalid_request", None),
        ('{"type":"shout","id":"a"}', "invalid_request", "a"),
        ('{"type":"generate","id":"a","prompt":"x","max_tokens":"9"}', "invalid_request", "a"),
        ('{"type":"generate","id":"a","prompt":"x","top_p":0}', "invalid_request", "a"),
        ('{"type":"generate","id":"a","prompt":"x","max_tokens":1001}', "invalid_request", "a"),
        ('{"type":"generate","id":"a"}', "invalid_request", "a"),
        ('{"type":"generate","id":"a","prompt":"","prompt_token_ids":[]}', "invalid_request", "a"),
        ('{"type":"generate","id":"a","prompt":""}', "invalid_request", "a"),
        ('{"type":"generate","id":"a","prompt_token_ids":[49152]}', "invalid_request", "a"),
        ('{"type":"generate","id":"a","messages":[]}', "invalid_request", "a"),
        ('{"type":"cancel","id":"zz"}', "invalid_request", "zz"),
        ('{"type":"generate","id":"a","prompt":"' + "x" * 5000 + '"}', "invalid_request", None),
    ],
)
def test_bad_frames_get_error_codes(
    session: GatewaySession, frame: str | bytes, code: str, client_id: str | None
) -> None:
    socket_id = session.connect()
    [error] = frames(session.on_frame(socket_id, frame))
    assert isinstance(error, Error), error
    assert (error.code, error.id) == (code, client_id), error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 5}, "min_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"prompt": None, "prompt_token_ids": [49152]}, "prompt"),
        ({"prompt": None, "messages": []}, "messages"),
        ({"prompt_token_ids": [1]}, None),  # two prompt forms: no one field at fault
    ],
)
def test_a_refusal_carries_the_field_at_fault(
    session: GatewaySession, fields: dict[str, object], param: str | None
) -> None:
    """Not re-read from the message: the OpenAI API answers with it as ``param``."""
    socket_id = session.connect()
    generate = msgspec.structs.replace(Generate(id="a", prompt="x"), **fields)
    [refusal] = session.on_generate(socket_id, generate)
    assert isinstance(refusal, SendFrame) and isinstance(refusal.frame, Error)
    assert (refusal.param, refusal.reason) == (param, None), refusal.frame.message


def test_a_draining_gateways_refusal_says_so_as_data(session: GatewaySession) -> None:
    socket_id = session.connect()
    session.start_draining()
    [refusal] = session.on_generate(socket_id, Generate(id="a", prompt="x"))
    assert isinstance(refusal, SendFrame) and isinstance(refusal.frame, Error)
    assert (refusal.frame.code, refusal.reason) == ("queue_full", "shutting_down")


def test_prompt_too_long_for_the_context(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits, clock: FakeClock
) -> None:
    # A frame limit that lets 8150 prompt ids through; with max_tokens 50 they exceed 8192.
    session = InlineTokenizingSession(
        SessionConfig(gateway_id="gw", max_frame_bytes=1 << 20), chat_tokenizer, model_limits, clock
    )
    socket_id = session.connect()
    ids = ",".join(["1"] * 8150)
    body = f'{{"type":"generate","id":"a","prompt_token_ids":[{ids}],"max_tokens":50}}'
    [error] = frames(session.on_frame(socket_id, body))
    assert isinstance(error, Error) and error.code == "prompt_too_long"
    body = f'{{"type":"generate","id":"a","prompt_token_ids":[{ids}],"max_tokens":42}}'
    assert isinstance(frames(session.on_frame(socket_id, body))[0], Accepted)


def test_duplicate_ids_and_the_in_flight_limit(session: GatewaySession) -> None:
    socket_id = session.connect()
    generate(session, socket_id, "a")
    [duplicate] = frames(session.on_frame(socket_id, '{"type":"generate","id":"a","prompt":"x"}'))
    assert isinstance(duplicate, Error) and duplicate.code == "invalid_request"
    generate(session, socket_id, "b")
    [full] = frames(session.on_frame(socket_id, '{"type":"generate","id":"c","prompt":"x"}'))
    assert isinstance(full, Error) and full.code == "queue_full" and full.id == "c"
    # Another socket has its own limit.
    generate(session, session.connect(), "c")


def test_token_ids_outside_the_vocabulary_are_a_dead_letter(session: GatewaySession) -> None:
    socket_id = session.connect()
    request_id = generate(session, socket_id, "a")
    good = SampledToken(request_id=request_id, token_id=5, index=0)
    bad = SampledToken(request_id=request_id, token_id=-1, index=1)
    [action] = session.on_gateway_message(batch(good, bad), "ch")
    assert isinstance(action, DeadLetter) and "vocabulary" in action.error
    # Nothing of the batch was applied: the good token still arrives once.
    assert [type(frame) for frame in frames(session.on_gateway_message(batch(good), "ch"))] == [
        Token
    ]


def test_a_closed_sockets_requests_wait_for_a_resume_then_end(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits, clock: FakeClock
) -> None:
    """With a grace, a closed socket cancels nothing: a resume within it picks
    the stream up live; a request nobody resumes is handed to the scheduler's
    judgement (a conditional cancel: another gateway may have taken it over)
    and forgotten here, so a later resume reads its log."""
    config = SessionConfig(gateway_id="gw", detach_grace_s=10.0)
    session = InlineTokenizingSession(config, chat_tokenizer, model_limits, clock)
    old = session.connect()
    kept = generate(session, old, "a")
    dropped = generate(session, old, "b")
    tokens = worker_tokens(chat_tokenizer, kept, "Hi there friend")
    session.on_gateway_message(batch(tokens[0]), "ch")
    assert session.disconnect(old) == []
    session.on_gateway_message(batch(tokens[1]), "ch")  # still running, nobody to tell
    clock.now_s += 5
    assert session.on_tick() == []
    new = session.connect()
    resume = f'{{"type":"resume","request_id":"{kept}","after_seq":0}}'
    replay = frames(session.on_frame(new, resume))
    assert [(type(f), f.seq) for f in replay] == [(Token, 1)]  # type: ignore[attr-defined]
    rest = frames(session.on_gateway_message(batch(*tokens[2:]), "ch"))
    assert isinstance(rest[-1], Done) and rest[-1].finish_reason == "length"
    clock.now_s += 6
    assert upstream(session.on_tick()) == [CancelRequest(request_id=dropped, gateway_id="gw")]
    assert session.stream(dropped) is None and session.stream(kept) is not None
    assert session.on_tick() == []


def test_a_resume_of_a_request_that_failed_elsewhere_replays_its_tokens_then_the_error(
    session: GatewaySession, chat_tokenizer: ChatTokenizer
) -> None:
    submit = SubmitRequest(
        request_id="elsewhere",
        gateway_id="dead-gateway",
        tenant="default",
        prompt_ids=chat_tokenizer.encode("Hello", add_special_tokens=True),
        sampling=SamplingParams(max_tokens=8),
    )
    log = RequestLog(record=RequestRecord(submit=submit, client_id="q"))
    for token in worker_tokens(chat_tokenizer, "elsewhere", " one two three four")[:2]:
        log.fold(b"1-0", TokenBatch(worker_id="w", tokens=[token]))
    log.fold(b"2-0", RequestFailed(request_id="elsewhere", code="internal", message="failed"))
    socket_id = session.connect()
    [load] = session.on_frame(socket_id, '{"type":"resume","request_id":"elsewhere","after_seq":0}')
    assert isinstance(load, LoadLog)
    replies = frames(session.on_log_loaded(socket_id, load.resume, log))
    assert [type(frame) for frame in replies] == [Token, Error]
    token, error = replies
    assert isinstance(token, Token) and (token.id, token.seq) == ("q", 1)
    assert error == Error(code="internal", message="failed", id="q")


def test_an_http_request_is_never_resumed_here_or_from_its_log(
    session: GatewaySession, chat_tokenizer: ChatTokenizer
) -> None:
    """Its frames belong to its HTTP response: a websocket of the same tenant
    that resumes it (with the id from ``chatcmpl-<request_id>``) gets an
    error, and the response keeps every token."""
    http = session.connect(resumable=False)
    request_id = generate(session, http, "a")
    tokens = worker_tokens(chat_tokenizer, request_id, "one two three four")
    session.on_gateway_message(batch(*tokens[:2]), "ch")
    thief = session.connect()
    resume = f'{{"type":"resume","request_id":"{request_id}","after_seq":0,"id":"b"}}'
    [refusal] = frames(session.on_frame(thief, resume))
    assert isinstance(refusal, Error) and refusal.code == "invalid_request"
    assert "came over HTTP" in refusal.message and refusal.id == "b"
    rest = [a for a in session.on_gateway_message(batch(*tokens[2:]), "ch")]
    assert {a.socket_id for a in rest if isinstance(a, SendFrame)} == {http}
    # From its log, on a gateway that never saw it: refused the same way.
    record = RequestRecord(
        submit=SubmitRequest(
            request_id="over-http",
            gateway_id="gw-1",
            tenant="default",
            prompt_ids=chat_tokenizer.encode("Hello", add_special_tokens=True),
            sampling=SamplingParams(max_tokens=8),
        ),
        client_id="q",
        resumable=False,
    )
    [load] = session.on_frame(thief, '{"type":"resume","request_id":"over-http"}')
    assert isinstance(load, LoadLog)
    [refusal] = frames(session.on_log_loaded(thief, load.resume, RequestLog(record=record)))
    assert isinstance(refusal, Error) and "came over HTTP" in refusal.message


def test_the_record_of_an_http_request_says_it_is_not_resumable(
    session: GatewaySession,
) -> None:
    for resumable in (True, False):
        socket_id = session.connect(resumable=resumable)
        actions = session.on_frame(
            socket_id, '{"type":"generate","id":"r","messages":[{"role":"user","content":"Hi"}]}'
        )
        [post] = [a for a in actions if isinstance(a, PostUpstream)]
        assert isinstance(post.log_entry, RequestRecord)
        assert post.log_entry.resumable is resumable
