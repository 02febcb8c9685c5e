"""Turn a client's ``generate`` into prompt ids and sampling parameters, or a typed error.

Pure: the tokenizer and the model's limits are passed in. Every check that can
fail raises :class:`RequestValidationError` carrying the protocol error code,
so the caller only has to turn it into an ``error`` frame.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from gateway.tokenizer import ChatTemplateError, ChatTokenizer
from shared.messages import SamplingParams
from shared.protocol import ErrorCode, Generate

MODEL_CONFIG_FILE_NAME = "config.json"


class RequestValidationError(ValueError):
    """A request the gateway refuses; ``code`` is the protocol error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message


@dataclass(frozen=True)
class ModelLimits:
    """What one model can take: its context and vocabulary, and the gateway's max_tokens cap."""

    context_tokens: int
    vocab_size: int
    max_tokens_limit: int

    @classmethod
    def from_model_dir(
        cls, model_dir: Path | str, vocab_size: int, max_tokens_limit: int
    ) -> ModelLimits:
        """Read ``max_position_embeddings`` from the model's ``config.json``.

        Read as plain JSON: the gateway never imports the worker's model code.
        """
        config_path = Path(model_dir) / MODEL_CONFIG_FILE_NAME
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            context_tokens = int(config["max_position_embeddings"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"cannot read max_position_embeddings from {config_path}") from error
        return cls(
            context_tokens=context_tokens, vocab_size=vocab_size, max_tokens_limit=max_tokens_limit
        )


@dataclass(frozen=True)
class ValidatedRequest:
    """A ``generate`` ready to submit."""

    prompt_ids: list[int]
    sampling: SamplingParams


def validate_generate(
    generate: Generate, tokenizer: ChatTokenizer, limits: ModelLimits
) -> ValidatedRequest:
    """Tokenize ``generate``'s prompt and check it against ``limits``.

    Cheap checks run before tokenizing, so a request refused for its
    parameters never pays for the chat template.
    """
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
        raise RequestValidationError(
            "invalid_request",
            "give exactly one of `messages`, `prompt`, `prompt_token_ids`"
            + (f" (got {', '.join(given)})" if given else ""),
        )
    if generate.max_tokens > limits.max_tokens_limit:
        raise RequestValidationError(
            "invalid_request",
            f"max_tokens {generate.max_tokens} is over the limit of {limits.max_tokens_limit}",
        )
    prompt_ids = _prompt_ids(generate, tokenizer, limits)
    if not prompt_ids:
        raise RequestValidationError("invalid_request", "the prompt is empty")
    num_tokens = len(prompt_ids) + generate.max_tokens
    if num_tokens > limits.context_tokens:
        raise RequestValidationError(
            "prompt_too_long",
            f"the prompt has {len(prompt_ids)} tokens; with max_tokens {generate.max_tokens} "
            f"that is {num_tokens}, over the model's context of {limits.context_tokens}",
        )
    sampling = SamplingParams(
        temperature=generate.temperature,
        top_p=generate.top_p,
        top_k=generate.top_k,
        # A seed for every request: token i then depends only on (seed, i), so a
        # recompute after a lost worker or scheduler samples the same tokens again.
        seed=generate.seed if generate.seed is not None else secrets.randbits(63),
        max_tokens=generate.max_tokens,
        # The worker adds the model's EOS and end-of-turn ids itself (unless ignore_eos).
        stop_token_ids=(),
        ignore_eos=generate.ignore_eos,
    )
    return ValidatedRequest(prompt_ids=prompt_ids, sampling=sampling)


def _prompt_ids(generate: Generate, tokenizer: ChatTokenizer, limits: ModelLimits) -> list[int]:
    if generate.messages is not None:
        if not generate.messages:
            raise RequestValidationError("invalid_request", "`messages` is empty")
        conversation = [{"role": m.role, "content": m.content} for m in generate.messages]
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        except ChatTemplateError as error:
            raise RequestValidationError("invalid_request", str(error)) from error
        # The rendered template already holds the model's special tokens.
        return tokenizer.encode(text, add_special_tokens=False)
    if generate.prompt is not None:
        return tokenizer.encode(generate.prompt, add_special_tokens=True)
    assert generate.prompt_token_ids is not None
    for token_id in generate.prompt_token_ids:
        if token_id >= limits.vocab_size:
            raise RequestValidationError(
                "invalid_request",
                f"prompt_token_ids holds {token_id}, not below the vocabulary size "
                f"{limits.vocab_size}",
            )
    return list(generate.prompt_token_ids)
