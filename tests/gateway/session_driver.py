"""The gateway core with the shell's tokenizer job run at once, for the core's tests."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from gateway.actions import Action, Tokenize
from gateway.session import GatewaySession, SessionConfig
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits, RequestValidationError, tokenize_generate


class InlineTokenizingSession(GatewaySession):
    """``on_frame`` answers as the shell would once the tokenizer pool is done:
    each ``Tokenize`` it emits is replaced by ``on_tokenized``'s (or
    ``on_tokenize_failed``'s) actions."""

    def __init__(
        self,
        config: SessionConfig,
        tokenizer: ChatTokenizer,
        limits: ModelLimits,
        clock: Callable[[], float],
        new_request_id: Callable[[], str] | None = None,
    ) -> None:
        counter = itertools.count()
        super().__init__(
            config, tokenizer, limits, clock, new_request_id or (lambda: f"r{next(counter)}")
        )
        self._test_tokenizer = tokenizer
        self._test_limits = limits

    def on_frame(self, socket_id: int, frame: str | bytes) -> list[Action]:
        return self.run_tokenize(super().on_frame(socket_id, frame))

    def run_tokenize(self, actions: list[Action]) -> list[Action]:
        """``actions`` with every Tokenize carried out, as the shell does it."""
        done: list[Action] = []
        for action in actions:
            if not isinstance(action, Tokenize):
                done.append(action)
                continue
            try:
                validated = tokenize_generate(
                    action.generate,
                    self._test_tokenizer,
                    self._test_limits,
                    action.max_tokens_cap,
                )
            except RequestValidationError as error:
                done += self.on_tokenize_failed(action.request_id, error)
            else:
                done += self.on_tokenized(action.request_id, action.generate, validated)
        return done
