"""The gateway core while draining: new requests refused, live ones run to the end."""

from __future__ import annotations

import msgspec

from gateway.actions import SendFrame
from gateway.session import SHUTTING_DOWN_MESSAGE, SessionConfig
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.messages import TokenBatch, encode
from shared.protocol import Accepted, Done, Error
from tests.gateway.session_driver import InlineTokenizingSession
from tests.gateway.worker_tokens import worker_tokens


def test_draining_refuses_new_requests_and_lets_live_ones_finish(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    session = InlineTokenizingSession(
        SessionConfig(gateway_id="gw"), chat_tokenizer, model_limits, clock=lambda: 0.0
    )
    socket_id = session.connect()

    def generate(client_id: str) -> object:
        body = {"type": "generate", "id": client_id, "prompt": "Hi", "max_tokens": 5}
        [action, *_] = session.on_frame(socket_id, msgspec.json.encode(body).decode())
        assert isinstance(action, SendFrame)
        return action.frame

    accepted = generate("a")
    assert isinstance(accepted, Accepted)
    assert session.num_live_requests == 1

    session.start_draining()
    assert generate("b") == Error(code="queue_full", message=SHUTTING_DOWN_MESSAGE, id="b")
    assert session.num_live_requests == 1

    tokens = worker_tokens(chat_tokenizer, accepted.request_id, "one two")
    actions = session.on_gateway_message(encode(TokenBatch(worker_id="w", tokens=tokens)), "tokens")
    sent = [action.frame for action in actions if isinstance(action, SendFrame)]
    assert isinstance(sent[-1], Done) and sent[-1].id == "a"
    assert session.num_live_requests == 0
