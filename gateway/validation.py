"""Turn a client's ``generate`` into prompt ids and sampling parameters, or a typed error.

Pure: the tokenizer and the limits are passed in. Every check that can fail
raises :class:`RequestValidationError` carrying the protocol error code and the
field at fault, so the caller only has to turn it into an ``error`` frame.
Two steps, so the caller can run the second off its event loop:
:func:`check_generate` (cheap, bounded by the frame: sizes, counts, ranges)
with :func:`min_request_tokens` (a lower bound on the tokens, from the
prompt's bytes), and :func:`tokenize_generate` (chat template and tokenizer,
over at most ``max_prompt_chars`` characters; then the prompt's length
settles a ``null`` max_tokens).
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from gateway.refusal import Refused
from gateway.tokenizer import ChatTemplateError, ChatTokenizer
from shared.messages import SamplingParams
from shared.protocol import PROTOCOL_LIMITS, ErrorCode, Generate, ProtocolLimits

MODEL_CONFIG_FILE_NAME = "config.json"


class RequestValidationError(Refused, ValueError):
    """A request the gateway refuses; ``code`` is the protocol error code,
    ``param`` the ``generate`` field at fault (a ``prompt_token_ids`` one is
    OpenAI's ``prompt``), when one is."""

    def __init__(self, code: ErrorCode, message: str, *, param: str | None = None) -> None:
        super().__init__(code, message, param=param)


@dataclass(frozen=True)
class ModelLimits:
    """What one model can take (context, vocabulary), the gateway's max_tokens cap and
    the protocol's caps."""

    context_tokens: int
    # Every id below it has an embedding row and a token the detokenizer knows.
    vocab_size: int
    max_tokens_limit: int
    protocol: ProtocolLimits = field(default=PROTOCOL_LIMITS)

    @classmethod
    def from_model_dir(
        cls, model_dir: Path | str, vocab_size: int, max_tokens_limit: int
    ) -> ModelLimits:
        """Read the context and vocabulary size from the model's ``config.json``.

        ``vocab_size`` is the tokenizer's; the limit is the smaller of it and the
        model's: an id the tokenizer has but the embedding lacks would index past
        the embedding on the worker, one the embedding has but the tokenizer lacks
        cannot be detokenized. Read as plain JSON: the gateway never imports the
        worker's model code.
        """
        config_path = Path(model_dir) / MODEL_CONFIG_FILE_NAME
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            context_tokens = int(config["max_position_embeddings"])
            model_vocab_size = int(config["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"cannot read max_position_embeddings and vocab_size from {config_path}"
            ) from error
        return cls(
            context_tokens=context_tokens,
            vocab_size=min(vocab_size, model_vocab_size),
            max_tokens_limit=max_tokens_limit,
        )


@dataclass(frozen=True)
class ValidatedRequest:
    """A ``generate`` ready to submit."""

    prompt_ids: list[int]
    sampling: SamplingParams


def validate_generate(
    generate: Generate, tokenizer: ChatTokenizer, limits: ModelLimits
) -> ValidatedRequest:
    """:func:`check_generate`, then :func:`tokenize_generate`."""
    check_generate(generate, limits)
    return tokenize_generate(generate, tokenizer, limits)


def check_generate(generate: Generate, limits: ModelLimits) -> None:
    """Every check that needs no tokenizer; raises :class:`RequestValidationError`.

    Its cost is linear in the frame, so it can run on the event loop; a request
    it refuses never pays for the chat template.
    """
    _check_prompt_form(generate, limits)
    _check_sampling(generate, limits)
    _check_stop(generate.stop, limits.protocol)


def num_prompt_chars(generate: Generate) -> int:
    """The characters of the prompt the tokenizer reads (the contents of
    ``messages``, or ``prompt``; none for ``prompt_token_ids``): what
    tokenizing it costs."""
    if generate.messages is not None:
        return sum(len(message.content) for message in generate.messages)
    return len(generate.prompt or "")


def min_request_tokens(
    generate: Generate,
    tokenizer: ChatTokenizer,
    limits: ModelLimits,
    max_tokens_cap: int | None = None,
) -> int:
    """A lower bound on the prompt tokens plus max_tokens ``generate`` comes to
    once tokenized (what its tenant's tokens per minute must hold), from the
    prompt's bytes alone (``ChatTokenizer.min_num_tokens``: cheap enough for
    the event loop); raises ``prompt_too_long`` when no prompt that long
    leaves the room it asks for in the context. Call after :func:`check_generate`."""
    num_prompt_tokens = _min_prompt_tokens(generate, tokenizer)
    context = limits.context_tokens
    if generate.max_tokens is not None:
        num_tokens = num_prompt_tokens + generate.max_tokens
        if num_tokens > context:
            raise RequestValidationError(
                "prompt_too_long",
                f"the prompt has at least {num_prompt_tokens} tokens (judged before "
                f"tokenizing it); with max_tokens {generate.max_tokens} that is at least "
                f"{num_tokens}, over the model's context of {context}",
            )
        return num_tokens
    num_generated = max(generate.min_tokens, 1)
    if num_prompt_tokens + num_generated > context:
        raise RequestValidationError(
            "prompt_too_long",
            f"the prompt has at least {num_prompt_tokens} tokens (judged before "
            f"tokenizing it), which leaves room for at most {max(context - num_prompt_tokens, 0)} "
            f"more in the model's context of {context}; the request generates at least "
            f"{num_generated}",
        )
    # A null max_tokens takes what the context leaves, up to the caps
    # (_resolve_max_tokens): prompt plus it grows with the prompt.
    cap = limits.max_tokens_limit if max_tokens_cap is None else max_tokens_cap
    return min(context, num_prompt_tokens + min(limits.max_tokens_limit, cap))


def _min_prompt_tokens(generate: Generate, tokenizer: ChatTokenizer) -> int:
    if generate.prompt_token_ids is not None:
        return len(generate.prompt_token_ids)
    if generate.prompt is not None:
        return tokenizer.min_num_tokens([generate.prompt])
    # Only the contents the template surely writes out count, less the
    # whitespace around them (a template may trim it).
    return tokenizer.min_num_tokens(
        message.content.strip()
        for message in generate.messages or []
        if message.role in tokenizer.roles_in_prompt
    )


def tokenize_generate(
    generate: Generate,
    tokenizer: ChatTokenizer,
    limits: ModelLimits,
    max_tokens_cap: int | None = None,
) -> ValidatedRequest:
    """Render and tokenize the prompt of a ``generate`` that passed :func:`check_generate`,
    check it fits the context and settle max_tokens (a ``null`` one takes what the
    context leaves); raises :class:`RequestValidationError`.

    Safe to call from a worker thread: it reads only its arguments, and the
    tokenizer is thread-safe (:class:`ChatTokenizer`).
    """
    prompt_ids = _prompt_ids(generate, tokenizer)
    if not prompt_ids:
        raise RequestValidationError("invalid_request", "the prompt is empty")
    max_tokens = _resolve_max_tokens(generate, len(prompt_ids), limits, max_tokens_cap)
    sampling = SamplingParams(
        # + 0.0 makes -0.0 plain 0.0 (greedy): no sampler has to know a signed zero.
        temperature=generate.temperature + 0.0,
        top_p=generate.top_p,
        top_k=generate.top_k,
        # A seed for every request: token i then depends only on (seed, i), so a
        # recompute after a lost worker or scheduler samples the same tokens again.
        seed=generate.seed if generate.seed is not None else secrets.randbits(63),
        max_tokens=max_tokens,
        # The worker adds the model's EOS and end-of-turn ids itself (unless ignore_eos).
        stop_token_ids=(),
        ignore_eos=generate.ignore_eos,
        min_tokens=generate.min_tokens,
    )
    return ValidatedRequest(prompt_ids=prompt_ids, sampling=sampling)


def _resolve_max_tokens(
    generate: Generate, num_prompt_tokens: int, limits: ModelLimits, cap: int | None
) -> int:
    """The max_tokens a request of ``num_prompt_tokens`` runs with: its own, or for
    ``null`` all the context leaves beside the prompt up to ``max_tokens_limit``
    (and ``cap``, its tenant's limit); raises ``prompt_too_long`` when that does
    not fit (or is below min_tokens)."""
    room = limits.context_tokens - num_prompt_tokens
    if generate.max_tokens is not None:
        if generate.max_tokens > room:
            raise RequestValidationError(
                "prompt_too_long",
                f"the prompt has {num_prompt_tokens} tokens; with max_tokens "
                f"{generate.max_tokens} that is {num_prompt_tokens + generate.max_tokens}, "
                f"over the model's context of {limits.context_tokens}",
            )
        return generate.max_tokens
    # check_generate already refused a min_tokens over max_tokens_limit.
    if room < max(generate.min_tokens, 1):
        raise RequestValidationError(
            "prompt_too_long",
            f"the prompt has {num_prompt_tokens} tokens, which leaves room for "
            f"{max(room, 0)} more in the model's context of {limits.context_tokens}; "
            f"the request generates at least {max(generate.min_tokens, 1)}",
        )
    return min(room, limits.max_tokens_limit, limits.max_tokens_limit if cap is None else cap)


def _invalid(message: str, param: str | None = None) -> RequestValidationError:
    return RequestValidationError("invalid_request", message, param=param)


def _check_prompt_form(generate: Generate, limits: ModelLimits) -> None:
    """Exactly one prompt form, within its caps."""
    protocol = limits.protocol
    given = [
        name
        for name, value in (
            ("messages", generate.messages),
            ("prompt", generate.prompt),
            ("prompt_token_ids", generate.prompt_token_ids),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise _invalid(
            "give exactly one of `messages`, `prompt`, `prompt_token_ids`"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if generate.messages is not None:
        messages = generate.messages
        if not messages:
            raise _invalid("`messages` is empty", "messages")
        if len(messages) > protocol.max_messages:
            raise _invalid(
                f"`messages` has {len(messages)} entries, over the limit of "
                f"{protocol.max_messages}",
                "messages",
            )
        for index, message in enumerate(messages):
            if message.role not in protocol.allowed_roles:
                raise _invalid(
                    f"messages[{index}].role {message.role[: protocol.max_role_chars]!r} is not "
                    f"one of {', '.join(sorted(protocol.allowed_roles))}",
                    "messages",
                )
        num_chars = sum(len(message.content) for message in messages)
        if num_chars > protocol.max_prompt_chars:
            raise _invalid(
                f"the contents of `messages` have {num_chars} characters, over the limit of "
                f"{protocol.max_prompt_chars}"
            )
    elif generate.prompt is not None:
        if len(generate.prompt) > protocol.max_prompt_chars:
            raise _invalid(
                f"`prompt` has {len(generate.prompt)} characters, over the limit of "
                f"{protocol.max_prompt_chars}",
                "prompt",
            )
    else:
        _check_prompt_token_ids(generate.prompt_token_ids or [], limits)


def _check_prompt_token_ids(prompt_token_ids: list[int], limits: ModelLimits) -> None:
    # Counted before the ids are looked at: more than the context never fits.
    if len(prompt_token_ids) > limits.context_tokens:
        raise RequestValidationError(
            "prompt_too_long",
            f"prompt_token_ids has {len(prompt_token_ids)} ids, over the model's context "
            f"of {limits.context_tokens}",
            param="prompt",
        )
    for index, token_id in enumerate(prompt_token_ids):
        if not 0 <= token_id < limits.vocab_size:
            raise _invalid(
                f"prompt_token_ids[{index}] is {token_id}, not in [0, {limits.vocab_size}) "
                "(the model's vocabulary)",
                "prompt",
            )


def _check_sampling(generate: Generate, limits: ModelLimits) -> None:
    """The ranges of shared/protocol.py again, for a ``Generate`` built without the
    decoder, and what only the gateway knows (its max_tokens cap, the context)."""
    _check_finite("temperature", generate.temperature)
    if not 0 <= generate.temperature <= 100:
        raise _invalid(f"temperature {generate.temperature} is not in [0, 100]", "temperature")
    _check_finite("top_p", generate.top_p)
    if not 0 < generate.top_p <= 1:
        raise _invalid(f"top_p {generate.top_p} is not in (0, 1]", "top_p")
    for name, value in (
        ("top_k", generate.top_k),
        ("seed", generate.seed),
        ("min_tokens", generate.min_tokens),
    ):
        if value is not None and not 0 <= value <= 2**63 - 1:
            raise _invalid(f"{name} {value} is not in [0, 2**63 - 1]", name)
    _check_token_counts(generate, limits)


def _check_finite(name: str, value: float) -> None:
    """NaN and ±inf are refused before any range is checked, and said so: a range
    check alone would refuse them, but with a message that reads as a bound."""
    if not math.isfinite(value):
        raise _invalid(f"{name} {value} is not a finite number", name)


def _check_token_counts(generate: Generate, limits: ModelLimits) -> None:
    """max_tokens (when given) and min_tokens: under the caps, in order, and leaving
    room for a prompt; a null max_tokens is settled once the prompt's length is known."""
    max_tokens = generate.max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            raise _invalid(f"max_tokens {max_tokens} is below 1", "max_tokens")
        if max_tokens > limits.max_tokens_limit:
            raise _invalid(
                f"max_tokens {max_tokens} is over the limit of {limits.max_tokens_limit}",
                "max_tokens",
            )
        if generate.min_tokens > max_tokens:
            raise _invalid(
                f"min_tokens {generate.min_tokens} is over max_tokens {max_tokens}", "min_tokens"
            )
    elif generate.min_tokens > limits.max_tokens_limit:
        # A null max_tokens resolves to at most the limit.
        raise _invalid(
            f"min_tokens {generate.min_tokens} is over the max_tokens limit of "
            f"{limits.max_tokens_limit}",
            "min_tokens",
        )
    # No prompt of at least one token fits beside either.
    for name, value in (("max_tokens", max_tokens), ("min_tokens", generate.min_tokens)):
        if value is not None and value >= limits.context_tokens:
            raise RequestValidationError(
                "prompt_too_long",
                f"{name} {value} leaves no room for a prompt in the model's "
                f"context of {limits.context_tokens}",
                param=name,
            )


def _check_stop(stop: list[str], protocol: ProtocolLimits) -> None:
    """Bounded so matching costs at most ``max_stop_bytes`` per generated token."""
    if len(stop) > protocol.max_stop_strings:
        raise _invalid(
            f"`stop` has {len(stop)} strings, over the limit of {protocol.max_stop_strings}",
            "stop",
        )
    num_bytes = 0
    for index, stop_string in enumerate(stop):
        if not 1 <= len(stop_string) <= protocol.max_stop_string_chars:
            raise _invalid(
                f"stop[{index}] has {len(stop_string)} characters, not in "
                f"[1, {protocol.max_stop_string_chars}]",
                "stop",
            )
        num_bytes += len(stop_string.encode("utf-8", "surrogatepass"))
    if num_bytes > protocol.max_stop_bytes:
        raise _invalid(
            f"`stop` has {num_bytes} UTF-8 bytes, over the limit of {protocol.max_stop_bytes}",
            "stop",
        )


def _prompt_ids(generate: Generate, tokenizer: ChatTokenizer) -> list[int]:
    if generate.messages is not None:
        conversation = [{"role": m.role, "content": m.content} for m in generate.messages]
        try:
            # Contents are text: a special token written in one is not a control token.
            return tokenizer.encode_chat(conversation, add_generation_prompt=True)
        except ChatTemplateError as error:
            raise _invalid(str(error)) from error
    if generate.prompt is not None:
        # A raw completion prompt is the client's whole model input, as with
        # prompt_token_ids (which can name any id): its special tokens are parsed,
        # as llama.cpp and vLLM do, so a client can write a template by hand.
        return tokenizer.encode(generate.prompt, add_special_tokens=True)
    assert generate.prompt_token_ids is not None
    return list(generate.prompt_token_ids)
