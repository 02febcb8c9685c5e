"""Fixtures of the gateway tests: the prepared SmolLM2 tokenizer and the model's limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits

MAX_TOKENS_LIMIT = 1000


@pytest.fixture(scope="session")
def chat_tokenizer(prepared_model_dir: Path) -> ChatTokenizer:
    """The real tokenizer of the model `orcapod model prepare` converts."""
    return ChatTokenizer.from_model_dir(prepared_model_dir)


@pytest.fixture(scope="session")
def model_limits(prepared_model_dir: Path, chat_tokenizer: ChatTokenizer) -> ModelLimits:
    """The prepared model's context (8192 for SmolLM2) and a small max_tokens cap."""
    return ModelLimits.from_model_dir(
        prepared_model_dir, chat_tokenizer.vocab_size, MAX_TOKENS_LIMIT
    )
