"""Hypothesis strategies for client frames the gateway must refuse, each with its error code.

Every frame drawn here is invalid on its own (never valid by accident of a
combination), so the property can demand an `error` for each one. The caps of
shared/protocol.py's ProtocolLimits are drawn here where a frame under
MAX_FRAME_BYTES can break them (the character cap on prompts cannot:
tests/gateway/test_validation_limits.py has it). The model's
numbers are constants because strategies are built at import time;
test_protocol_fuzz.py checks them against the real model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from shared.protocol import PROTOCOL_LIMITS, ErrorCode

CONTEXT_TOKENS = 8192  # SmolLM2's max_position_embeddings
VOCAB_SIZE = 49152
MAX_TOKENS_LIMIT = 1000  # tests/gateway/conftest.py
MAX_FRAME_BYTES = 32_768  # room for a prompt_too_long prompt of ids, well under 1 MiB
# Two requests of these ids are in flight on the fuzzed socket, so a generate (or a
# resume) taking one of their ids is a duplicate.
LIVE_IDS = ("live", "live2")
LIVE_ID = LIVE_IDS[0]
CLIENT_MESSAGE_TYPES = ("generate", "cancel", "resume")


def request_id_of(client_id: str) -> str:
    """Stands for the request_id of a live request (known only once it is accepted)."""
    return f"$request_id_of:{client_id}$"


@dataclass(frozen=True)
class BadFrame:
    """One frame and the code of the one `error` it must get."""

    kind: str
    data: str | bytes
    code: ErrorCode = "invalid_request"

    def sent_with(self, request_ids: dict[str, str]) -> str | bytes:
        """The frame, with the request_ids of the socket's live requests (client id ->
        request_id) where it refers to them."""
        if isinstance(self.data, bytes):
            return self.data
        data = self.data
        for client_id, request_id in request_ids.items():
            data = data.replace(request_id_of(client_id), request_id)
        return data

    def __repr__(self) -> str:
        shown = self.data if len(self.data) <= 300 else self.data[:300]
        cut = f"... ({len(self.data)} long)" if shown is not self.data else ""
        return f"BadFrame({self.kind!r}, {shown!r}{cut}, {self.code!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Hypothesis prints failing examples with this: keep huge frames short.
        printer.text(repr(self))


def to_json(value: Any) -> str:
    """JSON text as a client might write it: raw UTF-8, or escapes where the text has lone
    surrogates (a str holding one cannot be sent in a text frame at all)."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


# Text with lone surrogates too: they travel as `\ud800` escapes.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
SENDABLE_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT
# Floats include NaN and ±Infinity, which json.dumps writes as (invalid JSON) literals.
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)
CONTAINERS = st.lists(SCALARS, max_size=3) | st.dictionaries(ANY_TEXT, SCALARS, max_size=3)
NOT_STR = st.integers() | st.floats() | st.booleans() | CONTAINERS
# For list fields: a list of scalars may well be a valid one (`[]`, `["a"]`, `[1, 2]`).
NOT_A_LIST = (
    st.integers()
    | st.floats()
    | st.booleans()
    | ANY_TEXT
    | st.dictionaries(ANY_TEXT, SCALARS, max_size=3)
)
NOT_INT = st.floats() | st.booleans() | ANY_TEXT | CONTAINERS
NOT_NUMBER = st.booleans() | ANY_TEXT | CONTAINERS | st.none()
# Wrong for every integer field but after_seq (where -1 is allowed).
HUGE_OR_NEGATIVE = st.sampled_from([-1, -(2**63) - 1, 2**63, 2**64 - 1, 2**64, 10**30])
BAD_ID = st.just("") | st.text(min_size=129, max_size=140) | NOT_STR | st.none()
ALLOWED_ROLES = sorted(PROTOCOL_LIMITS.allowed_roles)
GOOD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(ALLOWED_ROLES), "content": SENDABLE_TEXT}
)
# Roles the template would render but the protocol does not take (near misses too).
UNKNOWN_ROLE = st.sampled_from(["User", "developer", "user ", "system\n", "<|im_start|>"]) | (
    ANY_TEXT.filter(lambda role: role not in PROTOCOL_LIMITS.allowed_roles)
)
BAD_MESSAGE = st.one_of(
    SCALARS,
    st.fixed_dictionaries({"role": st.just("") | st.text(min_size=33, max_size=40) | NOT_STR}),
    st.fixed_dictionaries({"role": UNKNOWN_ROLE, "content": SENDABLE_TEXT}),
    st.fixed_dictionaries({"role": st.just("user"), "content": NOT_STR | st.none()}),
    st.fixed_dictionaries({"role": st.just("user")}),
    st.fixed_dictionaries({"content": SENDABLE_TEXT}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.just("x"), "name": SCALARS}),
)
BAD_TOKEN_ID = st.integers(max_value=-1) | st.integers(min_value=VOCAB_SIZE) | NOT_INT | st.none()


# Valid stop strings, too many of them.
TOO_MANY_STOP_STRINGS = st.lists(
    SENDABLE_TEXT.filter(bool).map(lambda text: text[:8]),
    min_size=PROTOCOL_LIMITS.max_stop_strings + 1,
    max_size=PROTOCOL_LIMITS.max_stop_strings + 8,
)
# Few enough valid stop strings, too many UTF-8 bytes together: 5 to 16 strings of
# 205 to 256 characters of 1 to 4 bytes each make over 1024 bytes.
TOO_MANY_STOP_BYTES = st.lists(
    st.tuples(st.sampled_from(["x", "é", "€", "🦩"]), st.integers(205, 256)).map(
        lambda pair: pair[0] * pair[1]
    ),
    min_size=5,
    max_size=PROTOCOL_LIMITS.max_stop_strings,
)


def _with_one_bad(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> Any:
    """Lists of ``good`` items with at least one ``bad`` one among them."""
    return st.tuples(st.lists(good, max_size=2), bad, st.lists(good, max_size=2)).map(
        lambda parts: [*parts[0], parts[1], *parts[2]]
    )


def _outside(low: float, high: float, *, low_open: bool = False) -> st.SearchStrategy[Any]:
    """Numbers (ints and floats, NaN and infinities too) outside [low, high] (or (low, high])."""

    def is_outside(x: float) -> bool:
        inside = (low < x if low_open else low <= x) and x <= high
        return not inside

    return (st.floats() | st.integers() | HUGE_OR_NEGATIVE).filter(is_outside)


EXTREMES = (
    *(2**64, 2**64 - 1, 2**63, 2**63 - 1, 2**53 + 1, 10**30, -(10**30), -(2**63) - 1),
    *(-2, -1, 0, 1, 100, 101, 1.0, 0.5, -0.0, 1e-300, -1e-300, 1e308, -1e308, 100.00001),
    *(float("nan"), float("inf"), float("-inf")),  # JSON has no literal: json.dumps writes one
)


def _int_in(low: int, high: float) -> Any:
    return lambda x: type(x) is int and low <= x <= high


# The documented ranges (shared/protocol.py; max_tokens capped by the gateway).
NUMBER_RANGES: dict[str, Any] = {
    "max_tokens": _int_in(1, MAX_TOKENS_LIMIT),
    "temperature": lambda x: 0 <= x <= 100,
    "top_p": lambda x: 0 < x <= 1,
    "top_k": _int_in(0, 2**63 - 1),
    "seed": _int_in(0, 2**63 - 1),
    "after_seq": _int_in(-1, float("inf")),  # a huge after_seq only means nothing to replay yet
}
# Each value is wrong for its field whatever the other fields hold.
BAD_GENERATE_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "id": BAD_ID,
    "prompt": NOT_STR,
    "messages": st.just([])
    | NOT_STR
    | _with_one_bad(GOOD_MESSAGE, BAD_MESSAGE)
    # Over the count (short ones: the frame stays under max_frame_bytes).
    | st.integers(PROTOCOL_LIMITS.max_messages + 1, PROTOCOL_LIMITS.max_messages + 40).map(
        lambda count: [{"role": "user", "content": "x"}] * count
    ),
    "prompt_token_ids": st.just([]) | NOT_A_LIST | _with_one_bad(st.integers(0, 100), BAD_TOKEN_ID),
    # (null is valid: as many as the context leaves.)
    "max_tokens": st.integers(max_value=0)
    | st.integers(min_value=MAX_TOKENS_LIMIT + 1)
    | HUGE_OR_NEGATIVE
    | NOT_INT,
    "min_tokens": st.integers(max_value=-1) | st.integers(min_value=2**63) | NOT_INT | st.none(),
    "temperature": _outside(0, 100) | NOT_NUMBER,
    "top_p": _outside(0, 1, low_open=True) | NOT_NUMBER,
    # Over int64 would not fit the wire to the worker.
    "top_k": st.integers(max_value=-1) | st.integers(min_value=2**63) | HUGE_OR_NEGATIVE | NOT_INT,
    "seed": st.integers(max_value=-1) | st.integers(min_value=2**63) | HUGE_OR_NEGATIVE | NOT_INT,
    "stop": NOT_A_LIST
    | st.none()
    | _with_one_bad(SENDABLE_TEXT.filter(bool), st.just("") | st.text(min_size=257) | NOT_STR)
    | TOO_MANY_STOP_STRINGS
    | TOO_MANY_STOP_BYTES,
    "ignore_eos": st.integers() | st.floats() | ANY_TEXT | CONTAINERS | st.none(),
    "an unknown field": SCALARS,
}


@st.composite
def wrong_generate(draw: st.DrawFn) -> BadFrame:
    """A generate with one (mostly) to three fields of the wrong type or out of range, or
    a field the protocol does not have."""
    message: dict[str, Any] = {"type": "generate", "id": "fuzz", "prompt": "Hi"}
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        field = draw(st.sampled_from(sorted(BAD_GENERATE_VALUES)))
        if field == "prompt_token_ids":
            message.pop("prompt", None)
        message[field] = draw(BAD_GENERATE_VALUES[field])
    return BadFrame("wrong generate", to_json(message))


@st.composite
def extreme_number(draw: st.DrawFn) -> BadFrame:
    """One number at an extreme its field does not take, in an otherwise valid generate,
    or in a resume of the socket's live request (after_seq)."""
    field, valid = draw(st.sampled_from(sorted(NUMBER_RANGES.items())))
    value = draw(st.sampled_from(EXTREMES).filter(lambda number: not valid(number)))
    if field == "after_seq":
        message = {"type": "resume", "request_id": request_id_of(LIVE_ID), "after_seq": value}
    else:
        message = {"type": "generate", "id": "fuzz", "prompt": "Hi", field: value}
    return BadFrame(f"extreme {field}", to_json(message))


@st.composite
def wrong_cancel_or_resume(draw: st.DrawFn) -> BadFrame:
    """Cancels and resumes that are malformed or name nothing in flight here."""
    unknown_id = ANY_TEXT.filter(lambda text: text not in LIVE_IDS)
    # Request ids are 32 hex digits: none of these can name a real request.
    unknown_request_id = ANY_TEXT.filter(lambda text: len(text) != 32)
    message = draw(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("cancel"), "id": unknown_id | BAD_ID}),
            st.fixed_dictionaries({"type": st.just("cancel")}),
            st.fixed_dictionaries(
                {"type": st.just("cancel"), "id": st.sampled_from(LIVE_IDS), "why": SCALARS}
            ),
            st.fixed_dictionaries(
                {"type": st.just("resume"), "request_id": unknown_request_id | BAD_ID},
                optional={
                    "after_seq": st.integers() | HUGE_OR_NEGATIVE | NOT_INT,
                    "id": unknown_id | st.sampled_from(LIVE_IDS) | BAD_ID,
                },
            ),
            st.fixed_dictionaries({"type": st.just("resume"), "after_seq": st.integers()}),
        )
    )
    return BadFrame(f"wrong {message['type']}", to_json(message))


@st.composite
def random_json(draw: st.DrawFn) -> BadFrame:
    """Any JSON value; objects never carry a real `type`."""
    value = draw(JSON_VALUES)
    if isinstance(value, dict):
        value.pop("type", None)
    return BadFrame("random json", to_json(value))


@st.composite
def unknown_type(draw: st.DrawFn) -> BadFrame:
    """An object whose `type` is none of the protocol's (near misses included)."""
    near_misses = st.sampled_from(["Generate", "GENERATE", "generate ", "cancel\x00", "résumé", ""])
    kind = draw(near_misses | JSON_VALUES.filter(lambda v: v not in CLIENT_MESSAGE_TYPES))
    fields = draw(st.dictionaries(ANY_TEXT, SCALARS, max_size=3))
    return BadFrame("unknown type", to_json({**fields, "type": kind, "id": "fuzz"}))


@st.composite
def deeply_nested(draw: st.DrawFn) -> BadFrame:
    """Arrays or objects nested up to thousands deep, anywhere in a frame."""
    depth = draw(st.integers(2, (MAX_FRAME_BYTES - 100) // 6))  # "stop": [] would be valid
    if draw(st.booleans()):
        nested = "[" * depth + "]" * depth
    else:
        nested = '{"a":' * depth + "1" + "}" * depth
    where = draw(st.sampled_from(["top", "type", "id", "prompt", "messages", "stop", "extra"]))
    if where == "top":
        return BadFrame("deeply nested", nested)
    fields = {"type": '"generate"', "id": '"fuzz"', "prompt": '"Hi"', where: nested}
    return BadFrame("deeply nested", "{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}")


@st.composite
def oversized(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(data, is_text) of a frame over max_frame_bytes, which the websocket library
    refuses by closing the socket (1009): a valid generate padded with 1- to
    4-byte characters, so the limit is in bytes, not characters; text or binary."""
    character = draw(st.sampled_from(["x", "é", "€", "🦩"]))
    num_bytes = draw(st.integers(MAX_FRAME_BYTES + 1, 3 * MAX_FRAME_BYTES))
    prompt = character * (num_bytes // len(character.encode()) + 1)
    frame = to_json({"type": "generate", "id": "big", "prompt": prompt})
    return frame.encode(), draw(st.booleans())


@st.composite
def prompt_too_long(draw: st.DrawFn) -> BadFrame:
    """Prompt ids plus max_tokens over the model's context."""
    max_tokens = draw(st.integers(1, MAX_TOKENS_LIMIT))
    num_ids = draw(st.integers(CONTEXT_TOKENS - max_tokens + 1, CONTEXT_TOKENS + 50))
    frame = to_json(
        {
            "type": "generate",
            "id": "long",
            "max_tokens": max_tokens,
            "prompt_token_ids": [1] * num_ids,
        }
    )
    return BadFrame("prompt too long", frame, code="prompt_too_long")


def _literal_frames() -> st.SearchStrategy[BadFrame]:
    """Numbers JSON has no literal for, in every numeric field."""
    fields = ["max_tokens", "temperature", "top_p", "top_k", "seed"]
    literals = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "nan", "0x10", "+1", "01"]
    return st.builds(
        lambda field, literal: BadFrame(
            "number literal", f'{{"type":"generate","id":"n","prompt":"Hi","{field}":{literal}}}'
        ),
        st.sampled_from(fields),
        st.sampled_from(literals),
    )


BAD_FRAMES: st.SearchStrategy[BadFrame] = st.one_of(
    wrong_generate(),
    extreme_number(),
    wrong_cancel_or_resume(),
    random_json(),
    unknown_type(),
    deeply_nested(),
    prompt_too_long(),
    _literal_frames(),
    SENDABLE_TEXT.map(lambda text: BadFrame("text", text)),
    st.binary(max_size=200).map(lambda data: BadFrame("binary", data)),
    st.builds(  # a valid generate, but binary
        lambda text: BadFrame(
            "binary", to_json({"type": "generate", "id": "b", "prompt": text}).encode()
        ),
        SENDABLE_TEXT,
    ),
    st.builds(  # valid in every way but its id, which is in flight on this socket
        lambda client_id, text: BadFrame(
            "duplicate id", to_json({"type": "generate", "id": client_id, "prompt": text})
        ),
        st.sampled_from(LIVE_IDS),
        ANY_TEXT,
    ),
    st.sampled_from(  # a resume of one live request under the id of the other
        [
            BadFrame(
                "duplicate id",
                to_json({"type": "resume", "request_id": request_id_of(mine), "id": theirs}),
            )
            for mine, theirs in (LIVE_IDS, LIVE_IDS[::-1])
        ]
    ),
)
