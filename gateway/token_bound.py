"""A lower bound on the number of tokens a text encodes to, from its UTF-8 bytes
alone. Pure, and cheap enough for the event loop (one table look-up per byte
in numpy: about 0.15 ms for 100,000 characters), so a prompt that certainly
exceeds the context or its tenant's tokens per minute is refused before it
waits for, and takes, the tokenizer threads.

Why it holds, for a byte-level BPE tokenizer without a normalizer: the tokens
of an encoding cover runs of the text's bytes that tile it (an added token
covers its own content), and a token covers exactly as many bytes as it has.
If ``longest[b]`` is the length in bytes of the longest token holding byte
``b``, each token adds at most 1 to the sum, over the text's bytes, of
``1 / longest[b]``; so that sum is at most the number of tokens. With
SmolLM2 a lowercase letter counts 1/25 of a token or so, a digit a whole one
(digits are tokens of their own), a space 1/81.

Any other tokenizer (a normalizer, which may shrink the text; a pre-tokenizer
that drops text; an added token that swallows the whitespace beside it) gets
no bound: ``TokenCountBound.of`` returns None and every prompt is tokenized.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
from tokenizers import Tokenizer

# A token, in the units the bound sums bytes' shares in (a byte's share rounds
# down by less than one unit: under a token per 2**20 bytes in all).
TOKEN_UNITS = 1 << 20
# Pre-tokenizers that only split (or, ByteLevel, map bytes to characters one to one).
_SPLITTING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Split", "Punctuation"})


class TokenCountBound:
    """``min_num_tokens(texts)``: at most the number of tokens ``texts`` encode
    to, as parts of one prompt."""

    def __init__(self, longest_by_byte: list[int]) -> None:
        """``longest_by_byte[b]``: the longest token (in bytes) holding byte ``b``;
        0 for a byte no token holds (it is not counted)."""
        assert len(longest_by_byte) == 256
        # Each byte's share of a token in units of 1 / TOKEN_UNITS, rounded down
        # (so the sum stays a lower bound) and summed as integers (so exactly).
        self._units_by_byte = np.array(
            [0 if longest == 0 else TOKEN_UNITS // longest for longest in longest_by_byte],
            dtype=np.int32,
        )  # [256]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenCountBound | None:
        """The bound of ``tokenizer``, or None when the argument above does not
        hold for it (see the module's docstring)."""
        config = json.loads(tokenizer.to_str())
        if config.get("normalizer") is not None or not _is_byte_level_bpe(config):
            return None
        added = list(tokenizer.get_added_tokens_decoder().values())
        if any(token.lstrip or token.rstrip for token in added):
            return None
        alphabet = _byte_level_alphabet()
        to_bytes = {ord(char): byte for byte, char in enumerate(alphabet)}
        outside_alphabet = {ord(char): None for char in alphabet}
        added_contents = {token.content for token in added}
        token_bytes = [token.content.encode("utf-8") for token in added]
        for text in tokenizer.get_vocab(with_added_tokens=False):
            # A token with a character outside the alphabet is never produced.
            if text not in added_contents and not text.translate(outside_alphabet):
                token_bytes.append(text.translate(to_bytes).encode("latin-1"))
        # Every byte of every token, beside that token's length.
        lengths = [len(data) for data in token_bytes]
        longest = np.zeros(256, dtype=np.int64)
        np.maximum.at(
            longest,
            np.frombuffer(b"".join(token_bytes), dtype=np.uint8),
            np.repeat(np.array(lengths, dtype=np.int64), lengths),
        )
        longest_by_byte = [int(length) for length in longest]
        return cls(longest_by_byte)

    def min_num_tokens(self, texts: Iterable[str]) -> int:
        """At most the number of tokens of a prompt holding each of ``texts``
        (disjoint parts of it, as they are; the rest of the prompt may hold
        anything)."""
        total_units = 0
        for text in texts:
            data = np.frombuffer(text.encode("utf-8", "ignore"), dtype=np.uint8)
            total_units += int(np.take(self._units_by_byte, data).sum(dtype=np.int64))
        return -(-total_units // TOKEN_UNITS)


def _is_byte_level_bpe(config: dict[str, Any]) -> bool:
    """A BPE model behind a ByteLevel pre-tokenizer, maybe in a sequence of
    pre-tokenizers that only split."""
    if config.get("model", {}).get("type") != "BPE":
        return False
    pre_tokenizer = config.get("pre_tokenizer") or {}
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer])
    if not any(step.get("type") == "ByteLevel" for step in steps):
        return False
    return all(
        step.get("type") in _SPLITTING_PRE_TOKENIZERS and step.get("behavior") != "Removed"
        for step in steps
    )


def _byte_level_alphabet() -> list[str]:
    """The character the ByteLevel pre-tokenizer writes for each byte (GPT-2's
    table: printable bytes stand for themselves, the others are moved past 255)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet: list[str] = []
    num_moved = 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + num_moved))
            num_moved += 1
    return alphabet
