"""A refused request as data: the protocol's error code, the message for the
client, and what the message says in prose that a protocol has fields for.
Pure.

Raised where a refusal is decided (``gateway/validation.py``,
``gateway/admission.py``, ``gateway/tokenize_queue.py``) and carried on the
``error`` frame's ``SendFrame`` to the connection: a websocket sends the
frame alone; the OpenAI API answers with ``param`` and the status ``reason``
calls for (``gateway/openai_errors.py``).
"""

from __future__ import annotations

from typing import Literal

from shared.protocol import ErrorCode

# Why a refusal is answered otherwise than its code says over HTTP:
# ``shutting_down`` is a ``queue_full`` on a websocket, a 503 over HTTP.
RefusalReason = Literal["shutting_down"]


class Refused(Exception):
    """A request the gateway does not take on.

    ``code``: the protocol's error code; ``param``: the request field at
    fault (OpenAI's ``param``), when there is one; ``reason``: set when a
    protocol answers this refusal otherwise than ``code`` says."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        param: str | None = None,
        reason: RefusalReason | None = None,
    ) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.param = param
        self.reason: RefusalReason | None = reason
