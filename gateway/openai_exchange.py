"""One OpenAI request's response, made as the core's frames for it come
(:class:`Exchange`): nothing before the first token or the end, so a refusal
is a plain HTTP error with its status; after it, events through a bounded
:class:`gateway.outbox.Outbox`. No I/O: ``gateway/openai_endpoint.py``
sends what it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.actions import SendFrame
from gateway.openai_errors import OpenAIError, error_of_frame
from gateway.openai_reply import Reply
from gateway.openai_types import ParsedRequest
from gateway.outbox import Outbox
from shared.protocol import Accepted, Done, Error, Token


class Exchange:
    """One OpenAI request's frames, turned into its response as they come.

    Until the first token (or the end) nothing is answered, so a refusal
    (a bad prompt, a full queue) is a plain HTTP error with its status; after
    it, a stream's error is an ``error`` event. ``count_error`` counts an
    error that came in no frame (:meth:`end_with`).
    """

    def __init__(
        self,
        parsed: ParsedRequest,
        served_model: str,
        max_outbox_bytes: int,
        count_error: Callable[[OpenAIError], None],
    ) -> None:
        self.parsed = parsed
        self._served_model = served_model
        self._count_error = count_error
        self.outbox = Outbox(max_outbox_bytes)
        self._reply: Reply | None = None
        # Set on the first token, the end or an error: the response can begin.
        self.started = asyncio.Event()
        # Set at the end (a non-streaming body, or an error).
        self.finished = asyncio.Event()
        self.refusal: OpenAIError | None = None
        self.body: bytes | None = None

    def accept(self, request_id: str, num_prompt_tokens: int) -> None:
        """The core accepted the request as ``request_id``, its prompt
        ``num_prompt_tokens`` long (as tokenized)."""
        self._reply = Reply(
            self.parsed, self._served_model, request_id, num_prompt_tokens=num_prompt_tokens
        )

    def put(self, action: SendFrame) -> bool:
        """A ``token``, ``done`` or ``error`` frame the core sent (an ``error``
        with its refusal's data); False when the outbox went over its cap."""
        frame = action.frame
        assert not isinstance(frame, Accepted), "accepted comes through accept()"
        if self.finished.is_set():
            return True
        if isinstance(frame, Error):
            return self._error(error_of_frame(frame, action.param, action.reason))
        if self._reply is None:  # never before `accepted`; named all the same
            self._reply = Reply(self.parsed, self._served_model, "unaccepted", num_prompt_tokens=0)
        reply = self._reply
        if isinstance(frame, Token):
            # `seq` counts the request's tokens from 0.
            data = reply.token(frame.text, frame.seq + 1)
            if self.parsed.stream and not self.started.is_set():
                data = reply.head() + data
        else:
            assert isinstance(frame, Done)
            data = reply.done(frame)
            if not self.parsed.stream:
                self.body = data
                data = b""
            self.finished.set()
        self.started.set()
        fits = not data or self.outbox.put(data)
        if self.finished.is_set():
            self.outbox.close()
        return fits

    def end_with(self, error: OpenAIError) -> None:
        """End the response now with ``error`` (once streaming: an error event,
        then ``[DONE]``); what the core sends later is dropped."""
        if not self.finished.is_set():
            self._count_error(error)
            self._error(error)

    def _error(self, error: OpenAIError) -> bool:
        fits = True
        if self.parsed.stream and self.started.is_set() and self._reply is not None:
            fits = self.outbox.put(self._reply.stream_error(error))
        else:
            self.refusal = error
        self.started.set()
        self.finished.set()
        self.outbox.close()
        return fits
