"""What a client receives for a request, as the shell's SendFrame actions: its
stream's events (``token``, ``done``) and ``error`` frames. Pure."""

from __future__ import annotations

from gateway.actions import Action, SendFrame, ServerFrame
from gateway.refusal import Refused
from gateway.request_stream import Completion, EmittedToken, StreamEvent
from shared.protocol import Done, Error, ErrorCode, Token


def stream_frames(socket_id: int, client_id: str, events: list[StreamEvent]) -> list[Action]:
    """One frame per event of a request's stream, named by the client's ``client_id``."""
    actions: list[Action] = []
    for event in events:
        if isinstance(event, EmittedToken):
            frame: ServerFrame = Token(
                id=client_id, seq=event.seq, text=event.text, token_id=event.token_id
            )
        else:
            frame = done_frame(client_id, event)
        actions.append(SendFrame(socket_id, frame))
    return actions


def error_frames(
    socket_id: int, code: ErrorCode, message: str, client_id: str | None = None
) -> list[Action]:
    """One ``error`` frame (``client_id``: the request it ends, if any)."""
    return [SendFrame(socket_id, Error(code=code, message=message, id=client_id))]


def refusal_frames(socket_id: int, refused: Refused, client_id: str | None) -> list[Action]:
    """The ``error`` frame of a refused request, with its refusal's data."""
    frame = Error(code=refused.code, message=refused.message, id=client_id)
    return [SendFrame(socket_id, frame, param=refused.param, reason=refused.reason)]


def done_frame(client_id: str, completion: Completion) -> Done:
    """The ``done`` frame of a request that ended as ``completion`` says."""
    return Done(
        id=client_id,
        finish_reason=completion.finish_reason,
        usage=completion.usage,
        timings=completion.timings,
    )
