"""A request's stream and its min_tokens: a stop string ends it only from its
min_tokens-th token on."""

from __future__ import annotations

import msgspec
import pytest

from gateway.request_stream import Completion, EmittedToken, RequestStream
from gateway.tokenizer import ChatTokenizer
from shared.messages import SamplingParams, SubmitRequest
from tests.gateway.worker_tokens import worker_tokens

TEXT = "one END two END three"  # one token per word: 'one', ' END', ' two', ' END', ' three'


def stream_of(chat_tokenizer: ChatTokenizer, min_tokens: int) -> RequestStream:
    submit = SubmitRequest(
        request_id="r",
        gateway_id="gw",
        tenant="t",
        prompt_ids=chat_tokenizer.encode("Hello", add_special_tokens=False),
        sampling=SamplingParams(max_tokens=8, min_tokens=min_tokens),
    )
    return RequestStream.of_submit(submit, "c", ["END"], chat_tokenizer, accepted_at_s=0.0)


def run(stream: RequestStream, chat_tokenizer: ChatTokenizer) -> tuple[str, Completion, bool]:
    """Feed TEXT's tokens (the last one ends with length); the text sent, how it
    ended, and whether the gateway ended it itself."""
    text, cancel_upstream = "", False
    for token in worker_tokens(chat_tokenizer, "r", TEXT):
        update = stream.add(token, now_s=1.0)
        text += "".join(e.text for e in update.events if isinstance(e, EmittedToken))
        cancel_upstream |= update.cancel_upstream
    assert stream.completion is not None
    return text, stream.completion, cancel_upstream


def test_tokens_are_one_per_word(chat_tokenizer: ChatTokenizer) -> None:
    assert len(worker_tokens(chat_tokenizer, "r", TEXT)) == 5


@pytest.mark.parametrize(
    ("min_tokens", "text", "num_tokens"),
    [
        (0, "one ", 2),  # the first END (token 1) stops
        (2, "one ", 2),  # token 1 is the 2nd token: min_tokens reached, it stops
        (3, "one END two ", 4),  # the first END goes out as text; the second stops
        (4, "one END two ", 4),
        (5, TEXT, 5),  # no END ends at or after the 5th token
    ],
)
def test_a_stop_string_before_min_tokens_does_not_end_the_request(
    chat_tokenizer: ChatTokenizer, min_tokens: int, text: str, num_tokens: int
) -> None:
    sent, completion, cancel_upstream = run(stream_of(chat_tokenizer, min_tokens), chat_tokenizer)
    assert sent == text
    assert completion.usage.completion_tokens == num_tokens
    stopped = num_tokens < 5
    assert completion.finish_reason == ("stop" if stopped else "length")
    assert cancel_upstream == stopped


@pytest.mark.parametrize(
    ("first_cached", "later_cached", "expected"),
    [
        (None, None, 0),  # a worker that reports nothing
        (0, None, 0),
        (16, None, 16),
        (16, 32, 16),  # a later placement (after a preemption) does not count
        (10**9, None, 40),  # never more than the prompt
        (-5, None, 0),
    ],
)
def test_usage_reports_the_first_placements_cached_prompt_tokens(
    chat_tokenizer: ChatTokenizer, first_cached: int | None, later_cached: int | None, expected: int
) -> None:
    submit = SubmitRequest(
        request_id="r",
        gateway_id="gw",
        tenant="t",
        prompt_ids=list(range(100, 140)),
        sampling=SamplingParams(max_tokens=8),
    )
    stream = RequestStream.of_submit(submit, "c", [], chat_tokenizer, accepted_at_s=0.0)
    tokens = worker_tokens(chat_tokenizer, "r", "one two three")
    tokens[0] = msgspec.structs.replace(tokens[0], num_cached_tokens=first_cached)
    tokens[1] = msgspec.structs.replace(tokens[1], num_cached_tokens=later_cached)
    for token in tokens:
        stream.add(token, now_s=1.0)
    assert stream.completion is not None
    assert stream.completion.usage.prompt_tokens_details.cached_tokens == expected
