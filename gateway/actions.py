"""What the gateway core asks its shell to do: send a frame, tokenize a
prompt, post upstream, dead-letter, read or follow a request's log, wait.

Plain data, carried out by the shell in the order the core returns them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.refusal import RefusalReason
from gateway.tenants import Tenant, TokenReservation
from shared.messages import (
    CancelRequest,
    RequestAdopted,
    RequestEnded,
    RequestRecord,
    SubmitRequest,
)
from shared.protocol import Accepted, Done, Error, Generate, Resume, Token

ServerFrame = Accepted | Token | Done | Error


@dataclass(frozen=True)
class SendFrame:
    """Send ``frame`` on socket ``socket_id`` (dropped if it has closed meanwhile).

    An ``error`` frame's refusal comes with what its message says in prose,
    as data (``gateway/refusal.py``): a websocket sends the frame alone, an
    OpenAI response answers with them."""

    socket_id: int
    frame: ServerFrame
    # The request field at fault (OpenAI's ``param``).
    param: str | None = None
    reason: RefusalReason | None = None


@dataclass(frozen=True)
class Tokenize:
    """Tokenize ``generate`` off the event loop (the tokenizer pool, in
    ``tenant``'s queue there) and hand the result to
    ``GatewaySession.on_tokenized`` or ``on_tokenize_failed``.
    ``request_id`` is reserved meanwhile."""

    request_id: str
    generate: Generate
    tenant: Tenant
    # The prompt's characters: what tokenizing it costs (validation.num_prompt_chars).
    num_chars: int
    # The most a null max_tokens resolves to (the tenant's max_tokens_per_request).
    max_tokens_cap: int | None = None


@dataclass(frozen=True)
class PostUpstream:
    """XADD ``message``: a SubmitRequest to the requests stream, a CancelRequest or
    RequestAdopted to control; in the same transaction, append ``log_entry`` to
    the request's log.

    With a ``reservation``, a submit first takes its tokens from the tenant's
    per-minute budget in Redis; over it, the request ends in ``queue_full``
    (``GatewaySession.on_submit_refused``) and nothing is posted; a submit
    that Redis refuses ends the same way.
    """

    message: SubmitRequest | CancelRequest | RequestAdopted
    log_entry: RequestRecord | RequestEnded | None = None
    reservation: TokenReservation | None = None


@dataclass(frozen=True)
class LoadLog:
    """Read request ``request_id``'s log from Redis (a ``resume`` of a request
    this gateway does not know) and hand it to ``GatewaySession.on_log_loaded``."""

    socket_id: int
    request_id: str
    resume: Resume


@dataclass(frozen=True)
class FollowLog:
    """Read request ``request_id``'s log from after ``after_entry_id``, and its
    tokens in the journal from after ``after_journal_id``, as they grow, feeding
    ``GatewaySession.on_log_entries``, until the request is finished here.
    Tokens of a request another gateway accepted come this way."""

    request_id: str
    after_entry_id: bytes
    after_journal_id: bytes


@dataclass(frozen=True)
class DeadLetter:
    """XADD an undecodable message to the dead stream, with where it came from and why."""

    source: str
    error: str
    data: bytes


@dataclass(frozen=True)
class Wait:
    """Wait ``duration_s`` before the next action: the socket (or HTTP
    request) that asked reads nothing meanwhile. Paces a tenant's refusals
    (``gateway/refusal_pacer.py``)."""

    duration_s: float


Action = SendFrame | Tokenize | PostUpstream | DeadLetter | LoadLog | FollowLog | Wait
