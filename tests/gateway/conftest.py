"""Fixtures of the gateway tests: the prepared SmolLM2 tokenizer and the model's limits."""

from __future__ import annotations

import pytest

from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.settings import model_location

MAX_TOKENS_LIMIT = 1000


@pytest.fixture(scope="session")
def chat_tokenizer() -> ChatTokenizer:
    """The real tokenizer of the prepared model (``orcapod model prepare`` made it)."""
    model_dir = model_location().model_dir
    if not (model_dir / "tokenizer.json").is_file():
        pytest.skip(f"no prepared model at {model_dir}: run `orcapod model prepare`")
    return ChatTokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="session")
def model_limits(chat_tokenizer: ChatTokenizer) -> ModelLimits:
    """The prepared model's context (8192 for SmolLM2) and a small max_tokens cap."""
    return ModelLimits.from_model_dir(
        model_location().model_dir, chat_tokenizer.vocab_size, MAX_TOKENS_LIMIT
    )
