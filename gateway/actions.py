"""What the gateway core asks its shell to do: send a frame, post upstream, dead-letter.

Plain data, carried out by the shell in the order the core returns them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import CancelRequest, SubmitRequest
from shared.protocol import Accepted, Done, Error, Token

ServerFrame = Accepted | Token | Done | Error


@dataclass(frozen=True)
class SendFrame:
    """Send ``frame`` on socket ``socket_id`` (dropped if it has closed meanwhile)."""

    socket_id: int
    frame: ServerFrame


@dataclass(frozen=True)
class PostUpstream:
    """XADD ``message``: a SubmitRequest to the requests stream, a CancelRequest to control."""

    message: SubmitRequest | CancelRequest


@dataclass(frozen=True)
class DeadLetter:
    """XADD an undecodable message to the dead stream, with where it came from and why."""

    source: str
    error: str
    data: bytes


Action = SendFrame | PostUpstream | DeadLetter
