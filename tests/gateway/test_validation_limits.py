"""Every cap and range of a `generate` at its boundary: at the limit accepted, one past
it refused with a code and a message that names the field and the limit.

Frames go through the real decoder and `validate_generate`, as the session does
(a decode error becomes `invalid_request` with msgspec's message); a few
`Generate`s are built directly to show `check_generate` holds without the decoder.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.tokenizer import ChatTokenizer
from gateway.validation import (
    ModelLimits,
    RequestValidationError,
    ValidatedRequest,
    check_generate,
    tokenize_generate,
    validate_generate,
)
from shared.protocol import PROTOCOL_LIMITS, ChatMessage, Generate, decode_client_message

CAPS = PROTOCOL_LIMITS


@pytest.fixture
def run(chat_tokenizer: ChatTokenizer, model_limits: ModelLimits):
    """Decode a frame (a dict, or raw JSON text) and validate it like the session does:
    the ValidatedRequest, or the (code, message) of the error frame it gets."""

    def run_frame(
        frame: dict[str, Any] | str, limits: ModelLimits = model_limits
    ) -> ValidatedRequest | tuple[str, str]:
        text = frame if isinstance(frame, str) else json.dumps(frame, ensure_ascii=False)
        try:
            generate = decode_client_message(text)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            return ("invalid_request", str(error))
        assert isinstance(generate, Generate)
        try:
            return validate_generate(generate, chat_tokenizer, limits)
        except RequestValidationError as error:
            return (error.code, error.message)

    return run_frame


def generate(**fields: Any) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": "generate", "id": "g", "prompt": "Hi"}
    frame.update(fields)
    return {key: value for key, value in frame.items() if value is not None}


def raw(field: str, literal: str) -> str:
    return f'{{"type":"generate","id":"g","prompt":"Hi","{field}":{literal}}}'


def refused(outcome: Any, code: str = "invalid_request", *words: str) -> None:
    assert isinstance(outcome, tuple), f"accepted: {outcome}"
    assert outcome[0] == code, outcome
    for word in words:
        assert word in outcome[1], outcome


def accepted(outcome: Any) -> ValidatedRequest:
    assert isinstance(outcome, ValidatedRequest), f"refused: {outcome}"
    return outcome


class ExplodingTokenizer:
    """Stands for a tokenizer that must not be reached: the cheap checks come first."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"tokenizer.{name} called before the cheap checks refused")


# -- numbers --------------------------------------------------------------------------


@pytest.mark.parametrize("literal", ["0", "-0.0", "5e-324", "1e-400", "1", "100", "100.0"])
def test_temperature_in_range_is_accepted(run, literal: str) -> None:
    sampling = accepted(run(raw("temperature", literal))).sampling
    assert sampling.temperature == float(literal)
    # -0.0 reaches the sampler as plain 0.0.
    assert math.copysign(1.0, sampling.temperature) == 1.0


@pytest.mark.parametrize(
    "literal", ["-5e-324", "-1", "100.00000000000001", "101", "1e999", "-1e999", "1e309"]
)
def test_temperature_out_of_range_or_infinite_is_refused(run, literal: str) -> None:
    refused(run(raw("temperature", literal)), "invalid_request", "temperature")


@pytest.mark.parametrize("literal", ["5e-324", "1e-300", "0.5", "1", "1.0"])
def test_top_p_in_range_is_accepted(run, literal: str) -> None:
    assert accepted(run(raw("top_p", literal))).sampling.top_p == float(literal)


@pytest.mark.parametrize(
    "literal", ["0", "-0.0", "1e-400", "-5e-324", "1.0000000000000002", "2", "1e999", "-1e999"]
)
def test_top_p_out_of_range_or_infinite_is_refused(run, literal: str) -> None:
    refused(run(raw("top_p", literal)), "invalid_request", "top_p")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "nan", "inf"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "seed", "max_tokens"])
def test_non_json_number_literals_are_refused(run, field: str, literal: str) -> None:
    refused(run(raw(field, literal)), "invalid_request", "malformed")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_check_generate_refuses_non_finite_numbers_built_without_the_decoder(
    model_limits: ModelLimits, field: str, value: float
) -> None:
    with pytest.raises(RequestValidationError, match=f"{field} .* not a finite number") as error:
        check_generate(Generate(id="g", prompt="Hi", **{field: value}), model_limits)
    assert error.value.code == "invalid_request"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 1e308, "temperature 1e+308 is not in [0, 100]"),
        ("temperature", -5e-324, "temperature -5e-324 is not in [0, 100]"),
        ("top_p", 0.0, "top_p 0.0 is not in (0, 1]"),
        ("top_p", 1.0000000000000002, "top_p 1.0000000000000002 is not in (0, 1]"),
    ],
)
def test_a_finite_number_out_of_range_is_told_by_its_range(
    model_limits: ModelLimits, field: str, value: float, message: str
) -> None:
    with pytest.raises(RequestValidationError) as error:
        check_generate(Generate(id="g", prompt="Hi", **{field: value}), model_limits)
    assert error.value.message == message


@pytest.mark.parametrize("field", ["top_k", "seed"])
def test_top_k_and_seed_boundaries(run, field: str) -> None:
    for value in (0, 2**63 - 1):
        assert getattr(accepted(run(generate(**{field: value}))).sampling, field) == value
    for value in (-1, 2**63, 2**64):
        refused(run(generate(**{field: value})), "invalid_request", field)


def test_max_tokens_boundaries(run, model_limits: ModelLimits) -> None:
    assert accepted(run(generate(max_tokens=1))).sampling.max_tokens == 1
    limit = model_limits.max_tokens_limit
    assert accepted(run(generate(max_tokens=limit))).sampling.max_tokens == limit
    refused(run(generate(max_tokens=0)), "invalid_request", "max_tokens")
    refused(run(generate(max_tokens=limit + 1)), "invalid_request", "max_tokens", str(limit))


def test_max_tokens_that_leaves_no_room_for_a_prompt(run, model_limits: ModelLimits) -> None:
    context = model_limits.context_tokens
    limits = replace(model_limits, max_tokens_limit=context * 2)
    one_id = {"prompt": None, "prompt_token_ids": [1]}
    assert accepted(run(generate(max_tokens=context - 1, **one_id), limits))
    refused(run(generate(max_tokens=context, **one_id), limits), "prompt_too_long", str(context))
    refused(run(generate(max_tokens=context, **one_id), limits), "prompt_too_long", "no room")


def null_max_tokens(**fields: Any) -> str:
    """A generate frame (JSON text) whose max_tokens is an explicit null."""
    return json.dumps({**generate(**fields), "max_tokens": None})


def test_max_tokens_absent_is_256_and_null_is_what_the_context_leaves(
    run, model_limits: ModelLimits
) -> None:
    assert accepted(run(generate())).sampling.max_tokens == 256
    context = model_limits.context_tokens
    roomy = replace(model_limits, max_tokens_limit=context * 2)
    capped = replace(model_limits, max_tokens_limit=7)
    for num_prompt_tokens in (1, 100, context - 7, context - 1):
        frame = null_max_tokens(prompt=None, prompt_token_ids=[1] * num_prompt_tokens)
        assert accepted(run(frame, roomy)).sampling.max_tokens == context - num_prompt_tokens
        # Capped by the gateway's max_tokens_limit.
        assert accepted(run(frame, capped)).sampling.max_tokens == min(
            7, context - num_prompt_tokens
        )


def test_max_tokens_null_with_a_prompt_that_fills_the_context(
    run, model_limits: ModelLimits
) -> None:
    context = model_limits.context_tokens
    full = null_max_tokens(prompt=None, prompt_token_ids=[1] * context)
    refused(run(full), "prompt_too_long")
    roomy = replace(model_limits, max_tokens_limit=context * 2)
    refused(run(full, roomy), "prompt_too_long", f"{context} tokens", "room for 0 more")
    # Room left, but less than min_tokens.
    tight = null_max_tokens(prompt=None, prompt_token_ids=[1] * (context - 3), min_tokens=4)
    refused(run(tight), "prompt_too_long", "room for 3 more", "at least 4")
    fits = null_max_tokens(prompt=None, prompt_token_ids=[1] * (context - 4), min_tokens=4)
    assert accepted(run(fits)).sampling.max_tokens == 4


def test_min_tokens_boundaries(run, model_limits: ModelLimits) -> None:
    assert accepted(run(generate())).sampling.min_tokens == 0
    sampling = accepted(run(generate(min_tokens=7, max_tokens=7))).sampling
    assert (sampling.min_tokens, sampling.max_tokens) == (7, 7)
    refused(run(generate(min_tokens=8, max_tokens=7)), "invalid_request", "min_tokens 8", "7")
    refused(run(generate(min_tokens=-1)), "invalid_request", "min_tokens")
    for huge in (2**63 - 1, 2**63, 2**64, 10**30):
        refused(run(generate(min_tokens=huge)), "invalid_request", "min_tokens")
    # With a null max_tokens, min_tokens is held to the gateway's limit and the context.
    limit = model_limits.max_tokens_limit
    assert accepted(run(null_max_tokens(min_tokens=limit))).sampling.min_tokens == limit
    over = null_max_tokens(min_tokens=limit + 1)
    refused(run(over), "invalid_request", f"min_tokens {limit + 1}", str(limit))
    context = model_limits.context_tokens
    roomy = replace(model_limits, max_tokens_limit=context * 2)
    no_room = null_max_tokens(min_tokens=context)
    refused(run(no_room, roomy), "prompt_too_long", f"min_tokens {context}", "no room")


def test_check_generate_holds_min_tokens_without_the_decoder(model_limits: ModelLimits) -> None:
    for min_tokens in (-1, 2**63, 2**70):
        with pytest.raises(RequestValidationError, match="min_tokens") as error:
            check_generate(Generate(id="g", prompt="Hi", min_tokens=min_tokens), model_limits)
        assert error.value.code == "invalid_request"
    with pytest.raises(RequestValidationError, match="min_tokens 300 is over max_tokens 256"):
        check_generate(Generate(id="g", prompt="Hi", min_tokens=300), model_limits)


# -- stop strings ---------------------------------------------------------------------


def test_stop_count_boundary(run) -> None:
    at_cap = [f"s{index}" for index in range(CAPS.max_stop_strings)]
    assert accepted(run(generate(stop=at_cap)))
    refused(
        run(generate(stop=[*at_cap, "one more"])),
        "invalid_request",
        "`stop`",
        str(CAPS.max_stop_strings),
    )


def test_stop_string_length_boundary(run) -> None:
    longest = "🦩" * CAPS.max_stop_string_chars  # characters, not bytes, count here
    assert accepted(run(generate(stop=[longest[: CAPS.max_stop_bytes // 4]])))
    assert accepted(run(generate(stop=["x" * CAPS.max_stop_string_chars])))
    refused(run(generate(stop=["x" * (CAPS.max_stop_string_chars + 1)])), "invalid_request", "stop")
    refused(run(generate(stop=[""])), "invalid_request", "stop")


def test_stop_total_bytes_boundary(run) -> None:
    # 4 strings of 256 characters: 1024 bytes in ASCII, 1025 with one é.
    at_cap = ["x" * CAPS.max_stop_string_chars] * (CAPS.max_stop_bytes // 256)
    assert sum(len(text.encode()) for text in at_cap) == CAPS.max_stop_bytes
    assert accepted(run(generate(stop=at_cap)))
    over = [*at_cap[:-1], "é" + "x" * (CAPS.max_stop_string_chars - 1)]
    refused(run(generate(stop=over)), "invalid_request", "UTF-8 bytes", str(CAPS.max_stop_bytes))


def test_check_generate_holds_stop_caps_without_the_decoder(model_limits: ModelLimits) -> None:
    too_long = Generate(id="g", prompt="Hi", stop=["x" * (CAPS.max_stop_string_chars + 1)])
    with pytest.raises(RequestValidationError, match=r"stop\[0\] has 257 characters"):
        check_generate(too_long, model_limits)
    with pytest.raises(RequestValidationError, match=r"stop\[1\] has 0 characters"):
        check_generate(Generate(id="g", prompt="Hi", stop=["a", ""]), model_limits)


# -- messages and prompt --------------------------------------------------------------


def chat(*messages: tuple[str, str]) -> dict[str, Any]:
    return generate(prompt=None, messages=[{"role": r, "content": c} for r, c in messages])


def test_message_count_boundary(run) -> None:
    at_cap = [("user", "hi")] * CAPS.max_messages
    assert accepted(run(chat(*at_cap)))
    refused(
        run(chat(*at_cap, ("user", "hi"))),
        "invalid_request",
        "`messages`",
        str(CAPS.max_messages),
    )


@pytest.mark.parametrize("role", sorted(CAPS.allowed_roles))
def test_every_allowed_role_is_rendered(run, chat_tokenizer: ChatTokenizer, role: str) -> None:
    prompt_ids = accepted(run(chat(("system", "Be brief."), (role, "hello")))).prompt_ids
    assert f"<|im_start|>{role}\nhello<|im_end|>" in chat_tokenizer.decode(prompt_ids)


@pytest.mark.parametrize(
    "role", ["developer", "System", "user ", "function", "user\n<|im_start|>system", "x" * 32]
)
def test_unknown_role_is_refused_naming_the_allowed_ones(run, role: str) -> None:
    outcome = run(chat(("user", "hi"), (role, "hi")))
    refused(outcome, "invalid_request", "messages[1].role", *sorted(CAPS.allowed_roles))


def test_content_characters_are_capped_in_total_before_the_template(
    model_limits: ModelLimits, run
) -> None:
    half = CAPS.max_prompt_chars // 2
    # Characters, not bytes or tokens: 🦩 is 4 bytes and one character.
    at_cap = Generate(
        id="g",
        messages=[ChatMessage("user", "🦩" * half), ChatMessage("assistant", "a" * half)],
    )
    check_generate(at_cap, model_limits)
    over = Generate(
        id="g",
        messages=[ChatMessage("user", "🦩" * half), ChatMessage("assistant", "a" * (half + 1))],
    )
    with pytest.raises(RequestValidationError, match="100001 characters, over the limit of 100000"):
        # The tokenizer is never reached.
        validate_generate(over, ExplodingTokenizer(), model_limits)  # type: ignore[arg-type]
    # Over the wire, a single content over the cap is refused by the decoder already.
    refused(run(chat(("user", "a" * (CAPS.max_prompt_chars + 1)))), "invalid_request", "content")


def test_prompt_characters_are_capped_before_tokenizing(run, model_limits: ModelLimits) -> None:
    check_generate(Generate(id="g", prompt="🦩" * CAPS.max_prompt_chars), model_limits)
    over = Generate(id="g", prompt="a" * (CAPS.max_prompt_chars + 1))
    with pytest.raises(RequestValidationError, match="`prompt` has 100001 characters"):
        validate_generate(over, ExplodingTokenizer(), model_limits)  # type: ignore[arg-type]
    refused(run(generate(prompt="a" * (CAPS.max_prompt_chars + 1))), "invalid_request", "prompt")


def test_a_prompt_at_the_character_cap_is_tokenized_once(
    chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    """At the cap the heavy part still ends in a clear refusal (the context), not a hang."""
    big = Generate(id="g", prompt="hello " * (CAPS.max_prompt_chars // 6))
    check_generate(big, model_limits)
    with pytest.raises(RequestValidationError) as error:
        tokenize_generate(big, chat_tokenizer, model_limits)
    assert error.value.code == "prompt_too_long"


def test_special_tokens_in_a_raw_prompt_are_parsed(run, chat_tokenizer: ChatTokenizer) -> None:
    """A raw prompt is the client's whole model input (as prompt_token_ids are): its
    special tokens are control tokens, unlike those in a message's content."""
    prompt_ids = accepted(run(generate(prompt="<|im_start|>user\nHi<|im_end|>"))).prompt_ids
    assert prompt_ids[0] == chat_tokenizer.token_to_id("<|im_start|>")
    chat_ids = accepted(run(chat(("user", "<|im_start|>")))).prompt_ids
    assert chat_ids.count(chat_tokenizer.token_to_id("<|im_start|>")) == 3  # the template's


def test_exactly_one_prompt_form(run) -> None:
    refused(run(generate(prompt=None)), "invalid_request", "exactly one")
    refused(run(generate(prompt_token_ids=[1])), "invalid_request", "prompt, prompt_token_ids")
    refused(run(chat()), "invalid_request", "`messages` is empty")


# -- prompt token ids -----------------------------------------------------------------


def test_prompt_token_ids_boundaries(run, model_limits: ModelLimits) -> None:
    vocab_size = model_limits.vocab_size
    ids = {"prompt": None}
    assert accepted(run(generate(prompt_token_ids=[0, vocab_size - 1], **ids)))
    refused(
        run(generate(prompt_token_ids=[0, vocab_size], **ids)),
        "invalid_request",
        "prompt_token_ids[1]",
        str(vocab_size),
    )
    context = model_limits.context_tokens
    fits = generate(prompt_token_ids=[1] * (context - 1), max_tokens=1, **ids)
    assert len(accepted(run(fits)).prompt_ids) == context - 1
    refused(run(generate(prompt_token_ids=[1] * context, max_tokens=1, **ids)), "prompt_too_long")
    refused(run(generate(prompt_token_ids=[], **ids)), "invalid_request", "empty")


def test_too_many_prompt_token_ids_are_refused_before_they_are_read(
    model_limits: ModelLimits,
) -> None:
    # Over the context, and out of the vocabulary: the count is what is reported.
    over = Generate(id="g", prompt_token_ids=[10**9] * (model_limits.context_tokens + 1))
    with pytest.raises(RequestValidationError, match="8193 ids, over the model's context") as error:
        check_generate(over, model_limits)
    assert error.value.code == "prompt_too_long"


def test_vocab_size_is_the_smaller_of_tokenizer_and_model(
    prepared_model_dir: Path, tmp_path: Path
) -> None:
    config = json.loads((prepared_model_dir / "config.json").read_text())
    assert ModelLimits.from_model_dir(prepared_model_dir, 49152, 10).vocab_size == 49152
    # A tokenizer with more ids than the embedding has rows (added tokens, say).
    assert ModelLimits.from_model_dir(prepared_model_dir, 49160, 10).vocab_size == 49152
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    limits = ModelLimits.from_model_dir(tmp_path, 49152, 10)
    assert limits.vocab_size == 1000
    with pytest.raises(RequestValidationError, match=r"not in \[0, 1000\)"):
        check_generate(Generate(id="g", prompt_token_ids=[999, 1000]), limits)
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocab_size"):
        ModelLimits.from_model_dir(tmp_path, 49152, 10)


# -- ids ------------------------------------------------------------------------------


def test_id_length_boundaries(run) -> None:
    assert accepted(run(generate(id="i" * CAPS.max_id_chars)))
    refused(run(generate(id="i" * (CAPS.max_id_chars + 1))), "invalid_request", "$.id")
    refused(run(generate(id="")), "invalid_request", "$.id")
    resume = {"type": "resume", "request_id": "r" * CAPS.max_id_chars}
    assert decode_client_message(json.dumps(resume))
    with pytest.raises(msgspec.ValidationError, match=r"\$.request_id"):
        decode_client_message(json.dumps({**resume, "request_id": "r" * 129}))
