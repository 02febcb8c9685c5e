"""The lower bound on a prompt's tokens from its bytes never exceeds the real
count (SmolLM2's tokenizer, raw prompts and chats, texts built to fool it), is
tight enough to refuse long prose, and is not claimed for a tokenizer or a
chat template it does not hold for."""

from __future__ import annotations

import json
import random
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from gateway.token_bound import TokenCountBound
from gateway.tokenizer import ChatTokenizer

# Built to fool a bound: runs of the characters found in the longest tokens,
# alternated so that they do not merge, special tokens' text, digits, bytes of
# many-byte characters.
TRICKY_TEXTS = [
    "# " * 50_000,
    "#" * 100_000,
    " " * 100_000,
    "\n" + " " * 80 + "\n",
    "=-" * 50_000,
    "<|im_start|>" * 8_000,
    "<|im_start|" * 9_000,
    "1234567890" * 10_000,
    "🙂" * 25_000,
    "héllo 世界 " * 9_000,
    "".join(chr(code) for code in range(0x20, 0x3000)),
]


def _random_text(seed: int, alphabet: str, length: int) -> str:
    chooser = random.Random(seed)
    return "".join(chooser.choice(alphabet) for _ in range(length))


@pytest.mark.parametrize("text", TRICKY_TEXTS, ids=lambda text: repr(text[:12]))
def test_the_bound_holds_for_texts_built_to_fool_it(
    chat_tokenizer: ChatTokenizer, text: str
) -> None:
    bound = chat_tokenizer.min_num_tokens([text])
    assert bound <= len(chat_tokenizer.encode(text, add_special_tokens=True))
    chat = chat_tokenizer.encode_chat([{"role": "user", "content": text}])
    assert bound <= len(chat)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.lists(
            st.sampled_from([*string.printable, "é", "世", "🙂", "<|im_end|>", "Ġ", "\u200d"]),
            max_size=400,
        ).map("".join),
        min_size=1,
        max_size=4,
    )
)
def test_the_bound_holds_for_any_prompt_or_chat(
    chat_tokenizer: ChatTokenizer, contents: list[str]
) -> None:
    text = "".join(contents)
    assert chat_tokenizer.min_num_tokens([text]) <= len(
        chat_tokenizer.encode(text, add_special_tokens=True)
    )
    roles = ["system", "user", "assistant", "user"]
    messages = [
        {"role": roles[index % 4], "content": content} for index, content in enumerate(contents)
    ]
    stripped = [content.strip() for content in contents]
    assert chat_tokenizer.min_num_tokens(stripped) <= len(chat_tokenizer.encode_chat(messages))


def test_the_bound_on_words_is_several_times_that_of_the_longest_token(
    chat_tokenizer: ChatTokenizer,
) -> None:
    words = _random_text(0, string.ascii_lowercase + " ", 100_000)
    num_tokens = len(chat_tokenizer.encode(words, add_special_tokens=True))
    bound = chat_tokenizer.min_num_tokens([words])
    # Characters over SmolLM2's longest token (81 characters) would say 1,235.
    assert 3 * 1_235 <= bound <= num_tokens, (bound, num_tokens)


def test_no_bound_for_a_tokenizer_with_a_normalizer(chat_tokenizer: ChatTokenizer) -> None:
    config = json.loads(chat_tokenizer._tokenizer.to_str())
    assert TokenCountBound.of(Tokenizer.from_str(json.dumps(config))) is not None
    # NFC may make text shorter: the argument no longer holds.
    config["normalizer"] = {"type": "NFC"}
    assert TokenCountBound.of(Tokenizer.from_str(json.dumps(config))) is None
    normalized = ChatTokenizer(Tokenizer.from_str(json.dumps(config)), {})
    assert normalized.token_bound is None
    assert normalized.min_num_tokens(["1" * 1_000]) == 0


@pytest.mark.parametrize(
    ("template", "counted"),
    [
        # Trims contents: what is left of each still reaches the tokenizer.
        (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
            "<|im_end|>\n{% endfor %}",
            {"system", "user", "assistant"},
        ),
        # Drops the system message: no content is counted.
        (
            "{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}{% endfor %}",
            set(),
        ),
        # Refuses the probe: no content is counted.
        ("{{ raise_exception('no') }}", set()),
    ],
)
def test_contents_count_only_where_the_template_surely_writes_them(
    chat_tokenizer: ChatTokenizer, template: str, counted: set[str]
) -> None:
    custom = ChatTokenizer(chat_tokenizer._tokenizer, {"chat_template": template})
    assert custom.roles_in_prompt == counted
