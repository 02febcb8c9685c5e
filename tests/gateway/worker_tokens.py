"""Tokens as a worker would publish them, for the gateway tests."""

from __future__ import annotations

from gateway.tokenizer import ChatTokenizer
from shared.messages import FinishReason, SampledToken


def worker_tokens(
    tokenizer: ChatTokenizer, request_id: str, text: str, finish: FinishReason | None = "length"
) -> list[SampledToken]:
    """``text`` as the SampledTokens of one request, the last one carrying ``finish``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [
        SampledToken(
            request_id=request_id,
            token_id=token_id,
            index=index,
            finish_reason=finish if index == len(ids) - 1 else None,
        )
        for index, token_id in enumerate(ids)
    ]
