"""One request's token stream as the gateway serves it: pure, no I/O.

Puts sampled tokens in order (each ``index`` exactly once), detokenizes them
incrementally, applies stop strings (from the ``min_tokens``-th token on),
times the request and keeps the log of what it emitted so a client that
reconnects can ``resume``. The log is made of msgspec Structs without any
client or socket in them, so it could as well be kept in Redis for a resume
on another gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import ChatTokenizer, IncrementalDetokenizer
from shared.messages import FinishReason, SampledToken, SubmitRequest
from shared.protocol import PromptTokensDetails, Timings, Usage


class EmittedToken(msgspec.Struct, frozen=True):
    """One ``token`` frame as emitted, without the client's id (it may change on resume)."""

    seq: int
    text: str
    token_id: int


class Completion(msgspec.Struct, frozen=True):
    """How the request ended: the body of its ``done`` frame."""

    finish_reason: FinishReason
    usage: Usage
    timings: Timings


StreamEvent = EmittedToken | Completion


@dataclass
class StreamUpdate:
    """What one token batch did to a request: new events to send, and whether
    the gateway ended it itself (a stop string) so the scheduler must be told."""

    events: list[StreamEvent] = field(default_factory=list)
    cancel_upstream: bool = False


class RequestStream:
    """The gateway's state of one request, from ``accepted`` until it is forgotten.

    Where its frames go is the request table's business (``gateway/request_table.py``).
    ``tenant`` owns it: only a socket of that tenant may resume it.
    """

    def __init__(
        self,
        *,
        request_id: str,
        tenant: str,
        client_id: str,
        num_prompt_tokens: int,
        max_tokens: int,
        detokenizer: IncrementalDetokenizer,
        stop: Sequence[str],
        accepted_at_s: float,
        min_tokens: int = 0,
        resumable: bool = True,
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        # False for a request of an HTTP client: nobody else may take its frames.
        self.resumable = resumable
        # The id of the `generate`; a resume without an id of its own uses it.
        self.original_client_id = client_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self._detokenizer = detokenizer
        self._stop_matcher = StopStringMatcher(stop)
        # A stop string ends the request only in the text of its min_tokens-th token or later.
        self._min_tokens = min_tokens
        self._accepted_at_s = accepted_at_s
        self._first_token_at_s: float | None = None
        # When the request last moved (accepted, or a new token arrived): a
        # request silent for too long is ended by the session's stall check.
        self.last_progress_s = accepted_at_s
        self.next_seq = 0
        # Prompt tokens of the first placement whose K/V came from the prefix cache.
        self.num_cached_tokens = 0
        # Tokens that arrived ahead of a missing one, by index.
        self._pending: dict[int, SampledToken] = {}
        self.tokens: list[EmittedToken] = []
        self.completion: Completion | None = None
        self.finished_at_s: float | None = None

    @classmethod
    def of_submit(
        cls,
        submit: SubmitRequest,
        client_id: str,
        stop: Sequence[str],
        tokenizer: ChatTokenizer,
        accepted_at_s: float,
        *,
        resumable: bool = True,
    ) -> RequestStream:
        """The stream of a request as submitted (here, or by the gateway whose
        log this one took over)."""
        return cls(
            request_id=submit.request_id,
            tenant=submit.tenant,
            client_id=client_id,
            num_prompt_tokens=len(submit.prompt_ids),
            max_tokens=submit.sampling.max_tokens,
            detokenizer=IncrementalDetokenizer(tokenizer, submit.prompt_ids),
            stop=stop,
            accepted_at_s=accepted_at_s,
            min_tokens=submit.sampling.min_tokens,
            resumable=resumable,
        )

    @property
    def finished(self) -> bool:
        """True once ``done`` is decided; later tokens are dropped."""
        return self.completion is not None

    def add(self, token: SampledToken, now_s: float) -> StreamUpdate:
        """Take one sampled token (possibly a duplicate or out of order)."""
        update = StreamUpdate()
        # An index beyond max_tokens cannot be real: buffering it would grow without bound.
        if self.finished or token.index < self.next_seq or token.index >= self.max_tokens:
            return update
        if token.index not in self._pending:
            self.last_progress_s = now_s
        self._pending[token.index] = token
        while not self.finished and self.next_seq in self._pending:
            self._emit(self._pending.pop(self.next_seq), now_s, update)
        if self.finished:
            self._pending.clear()
        return update

    def cancel(self, now_s: float) -> Completion:
        """End the request as cancelled with what was sent so far (text held back is dropped)."""
        assert not self.finished, "cancel of a finished request"
        self._pending.clear()
        return self._complete("cancelled", now_s)

    def replay(self, after_seq: int) -> list[StreamEvent]:
        """Every event after token ``after_seq``, the ``done`` included once finished."""
        # seq == position in the log: tokens are appended in order from 0.
        events: list[StreamEvent] = list(self.tokens[max(after_seq + 1, 0) :])
        if self.completion is not None:
            events.append(self.completion)
        return events

    def _emit(self, token: SampledToken, now_s: float, update: StreamUpdate) -> None:
        if self._first_token_at_s is None:
            self._first_token_at_s = now_s
        if token.index == 0 and token.num_cached_tokens is not None:
            self.num_cached_tokens = min(max(token.num_cached_tokens, 0), self.num_prompt_tokens)
        is_last = token.finish_reason is not None
        delta = self._detokenizer.add(token.token_id)
        if is_last:
            delta += self._detokenizer.finish()
        result = self._stop_matcher.feed(delta, can_stop=token.index + 1 >= self._min_tokens)
        text = result.text
        if is_last and not result.stopped:
            text += self._stop_matcher.flush()
        emitted = EmittedToken(seq=token.index, text=text, token_id=token.token_id)
        self.tokens.append(emitted)
        self.next_seq += 1
        update.events.append(emitted)
        if result.stopped:
            update.events.append(self._complete("stop", now_s))
            # Upstream still generates unless this was its last token anyway.
            update.cancel_upstream = not is_last
        elif token.finish_reason is not None:
            update.events.append(self._complete(token.finish_reason, now_s))

    def _complete(self, finish_reason: FinishReason, now_s: float) -> Completion:
        ttft_ms = (
            None
            if self._first_token_at_s is None
            else (self._first_token_at_s - self._accepted_at_s) * 1000.0
        )
        self.completion = Completion(
            finish_reason=finish_reason,
            usage=Usage(
                prompt_tokens=self.num_prompt_tokens,
                completion_tokens=len(self.tokens),
                prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
            ),
            timings=Timings(ttft_ms=ttft_ms, total_ms=(now_s - self._accepted_at_s) * 1000.0),
        )
        self.finished_at_s = now_s
        return self.completion
