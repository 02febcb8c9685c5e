"""The client protocol: JSON text frames on ``ws://HOST:PORT/ws``.

Every frame is an object with a ``type`` field. Client → server: ``generate``,
``cancel``, ``resume``. Server → client: ``accepted``, ``token``, ``done``,
``error``. Many requests may be in flight on one socket; ``id`` is the
client's name for a request, ``request_id`` the service's.

Ranges are part of the types (msgspec ``Meta``), so a decode error already
says which field is wrong and why. Caps that span several fields (how many
stop strings, how much prompt text) are :class:`ProtocolLimits`, checked by
``gateway/validation.py`` before any tokenizing; ``docs/reliability.md`` has
the whole table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec


@dataclass(frozen=True)
class ProtocolLimits:
    """The caps a ``generate`` must keep, beyond the numeric ranges of its fields.

    Each bounds what one request can make the gateway do before it is refused
    or admitted: the chat template and tokenizer run over at most
    ``max_prompt_chars`` characters, and stop-string matching costs at most
    ``max_stop_bytes`` of work per generated token.
    """

    max_id_chars: int = 128
    max_messages: int = 512
    # The roles chat templates (SmolLM2's ChatML among them) render as a turn.
    # The template writes the role itself into the prompt, so a free-form role
    # would be a way to write special tokens into it.
    allowed_roles: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})
    max_role_chars: int = 32
    # Characters of all message contents together, or of `prompt`.
    max_prompt_chars: int = 100_000
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_bytes: int = 1024  # UTF-8 bytes of all stop strings together


PROTOCOL_LIMITS = ProtocolLimits()

ClientId = Annotated[str, msgspec.Meta(min_length=1, max_length=PROTOCOL_LIMITS.max_id_chars)]
ErrorCode = Literal["invalid_request", "unauthorized", "queue_full", "prompt_too_long", "internal"]


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One turn of a conversation, rendered with the model's chat template."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=PROTOCOL_LIMITS.max_role_chars)]
    content: Annotated[str, msgspec.Meta(max_length=PROTOCOL_LIMITS.max_prompt_chars)]


class Generate(
    msgspec.Struct, frozen=True, tag="generate", tag_field="type", forbid_unknown_fields=True
):
    """Start a request: exactly one of ``messages``, ``prompt``, ``prompt_token_ids``."""

    id: ClientId
    messages: list[ChatMessage] | None = None
    prompt: Annotated[str, msgspec.Meta(max_length=PROTOCOL_LIMITS.max_prompt_chars)] | None = None
    prompt_token_ids: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None
    # Absent: 256. ``null``: as many as the context leaves beside the prompt, up to
    # the gateway's cap (resolved by ``gateway/validation.py`` once the prompt is tokenized).
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = 256
    # No end-of-turn token, stop token or stop string ends the request before this many tokens.
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    # Bounded so the SubmitRequest can carry it (MessagePack ints end at 2**64).
    top_k: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    stop: list[
        Annotated[str, msgspec.Meta(min_length=1, max_length=PROTOCOL_LIMITS.max_stop_string_chars)]
    ] = []
    ignore_eos: bool = False


class Cancel(
    msgspec.Struct, frozen=True, tag="cancel", tag_field="type", forbid_unknown_fields=True
):
    """Stop a request of this socket; it ends with ``done`` (finish_reason cancelled)."""

    id: ClientId


class Resume(
    msgspec.Struct, frozen=True, tag="resume", tag_field="type", forbid_unknown_fields=True
):
    """Reattach to a request (after a reconnect) and receive tokens after ``after_seq``."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=PROTOCOL_LIMITS.max_id_chars)]
    after_seq: Annotated[int, msgspec.Meta(ge=-1)] = -1
    id: ClientId | None = None


ClientMessage = Generate | Cancel | Resume


class Accepted(msgspec.Struct, frozen=True, tag="accepted", tag_field="type"):
    """The request is queued under ``request_id``."""

    id: str
    request_id: str


class Token(msgspec.Struct, frozen=True, tag="token", tag_field="type"):
    """New text of a request; ``seq`` counts generated tokens from 0."""

    id: str
    seq: int
    text: str
    token_id: int


class PromptTokensDetails(msgspec.Struct, frozen=True):
    """Of the prompt tokens, ``cached_tokens`` had their K/V in the prefix cache."""

    cached_tokens: int = 0


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class Timings(msgspec.Struct, frozen=True):
    ttft_ms: float | None
    total_ms: float


class Done(msgspec.Struct, frozen=True, tag="done", tag_field="type"):
    """The request ended; nothing more comes for ``id``."""

    id: str
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage
    timings: Timings


class Error(msgspec.Struct, frozen=True, tag="error", tag_field="type"):
    """Something was wrong; ``id`` names the request when there is one."""

    code: ErrorCode
    message: str
    id: str | None = None


ServerMessage = Accepted | Token | Done | Error

_client_decoder = msgspec.json.Decoder(ClientMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)
_json_encoder = msgspec.json.Encoder()


def decode_client_message(frame: str | bytes) -> Generate | Cancel | Resume:
    """Parse a client frame; raises ``msgspec.DecodeError``/``ValidationError`` with the reason."""
    try:
        return _client_decoder.decode(frame)
    except RecursionError as error:
        # msgspec recurses per level of nesting: a frame nested thousands deep is malformed input.
        raise msgspec.DecodeError("JSON is nested too deeply") from error


def decode_server_message(frame: str | bytes) -> Accepted | Token | Done | Error:
    """Parse a server frame (for clients and tests)."""
    return _server_decoder.decode(frame)


def encode_json(message: msgspec.Struct) -> str:
    """A protocol message as the JSON text of one frame."""
    return _json_encoder.encode(message).decode("utf-8")
