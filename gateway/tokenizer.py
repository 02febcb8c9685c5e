"""The chat tokenizer: chat template, encode, decode, and streaming detokenization.

Loaded from a Hugging Face-format model directory (``tokenizer.json`` and
``tokenizer_config.json``) with the ``tokenizers`` library and jinja2 alone:
transformers is far too heavy for the gateway and is used only by the tests, to
check this module agrees with it.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding, Tokenizer

from gateway.token_bound import TokenCountBound

TOKENIZER_FILE_NAME = "tokenizer.json"
TOKENIZER_CONFIG_FILE_NAME = "tokenizer_config.json"

# End-of-turn markers of common chat templates (ChatML, Llama 3, Phi-3); the
# model emits them, not eos, at the end of its reply.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

REPLACEMENT_CHARACTER = "\ufffd"
# A character is at most 4 UTF-8 bytes, so at most 3 of them can wait for more.
MAX_INCOMPLETE_CHARACTER_BYTES = 3
# Tokens the detokenizer waits on for text before it lets go of all but the last
# MAX_INCOMPLETE_CHARACTER_BYTES: bounds the decode window, so the cost per token.
MAX_PENDING_TOKENS = 8


class ModelDirectoryError(ValueError):
    """A model directory lacks a tokenizer file or has an unreadable one."""


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (its ``raise_exception``) or failed to render."""


class ChatTokenizer:
    """Tokenizer plus chat template of one model; immutable once loaded, safe to share.

    Safe to call from several threads at once: ``tokenizers.Tokenizer.encode``
    and ``decode`` take the tokenizer by shared reference (only its setters
    need it exclusively, and none is called after ``__init__``), and a jinja
    template's ``render`` builds a fresh context per call.
    """

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        # A second tokenizer that reads special-token text as plain text, for the
        # clients' message contents. A copy, because the flag is a setter on the
        # tokenizer: flipping it per call would race between threads.
        self._plain_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._plain_tokenizer.encode_special_tokens = True
        self._special_token_ids = frozenset(
            token_id
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special
        )
        self._special_token_texts = tuple(
            added.content
            for added in tokenizer.get_added_tokens_decoder().values()
            if added.special
        )
        self._config = config
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        template_source = _chat_template_source(config.get("chat_template"))
        self._template = None if template_source is None else _compile_template(template_source)
        self._chat_template_source = template_source or ""
        self.eos_token_id = (
            None if self.eos_token is None else tokenizer.token_to_id(self.eos_token)
        )
        self.stop_token_ids: frozenset[int] = frozenset(self._find_stop_token_ids())
        # A lower bound on a prompt's tokens from its bytes (gateway/token_bound.py;
        # None: none holds for this tokenizer), and the roles whose contents the
        # bound may count in a chat (those the template surely writes out).
        self.token_bound = TokenCountBound.of(tokenizer)
        self.roles_in_prompt: frozenset[str] = self._roles_written_out()

    @classmethod
    def from_model_dir(cls, model_dir: Path | str) -> ChatTokenizer:
        """Load from ``model_dir``; raises :class:`ModelDirectoryError` naming a missing file."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelDirectoryError(f"model directory {model_dir} does not exist")
        tokenizer_path = _required_file(model_dir, TOKENIZER_FILE_NAME)
        config_path = _required_file(model_dir, TOKENIZER_CONFIG_FILE_NAME)
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as error:  # tokenizers raises a bare Exception on bad JSON
            raise ModelDirectoryError(f"cannot load {tokenizer_path}: {error}") from error
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except ValueError as error:
            raise ModelDirectoryError(f"cannot parse {config_path}: {error}") from error
        return cls(tokenizer, config)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (``{"role": ..., "content": ...}``) into the prompt text."""
        if self._template is None:
            raise ChatTemplateError("the model's tokenizer_config.json has no chat_template")
        # The same variables Hugging Face passes, so templates written for it work.
        special_tokens = {
            key: _token_content(self._config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **special_tokens,
            )
        except TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {error}") from error

    def encode_chat(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat, with each message's content encoded as plain text.

        The template's own special tokens (``<|im_start|>``, say) become their
        ids; special-token text inside a content stays text, so a client cannot
        write a turn of its own into the prompt. Raises :class:`ChatTemplateError`.
        """
        pieces = self._render_pieces(messages, add_generation_prompt)
        if pieces is None:
            # The template does not copy contents verbatim (it trims them, say), so
            # they cannot be told apart in the prompt: refuse only what could inject.
            for message in messages:
                if any(special in message["content"] for special in self._special_token_texts):
                    raise ChatTemplateError(
                        "message content holds a special token, which this model's chat "
                        "template cannot keep as text"
                    )
            text = self.apply_chat_template(messages, add_generation_prompt)
            return self.encode(text, add_special_tokens=False)
        # Text between two special tokens of the template, contents included, is
        # encoded as one run: the tokenizer splits at special tokens before
        # anything else, so a conversation without special-token text in its
        # contents gets exactly the ids of encoding the rendered prompt whole.
        token_ids: list[int] = []
        run: list[str] = []
        for index, piece in enumerate(pieces):
            if index % 2 == 1:  # a content
                run.append(piece)
                continue
            for part in self._split_at_special_tokens(piece):
                if isinstance(part, int):
                    token_ids += self._encode_plain("".join(run))
                    token_ids.append(part)
                    run = []
                else:
                    run.append(part)
        token_ids += self._encode_plain("".join(run))
        return token_ids

    def _render_pieces(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool
    ) -> list[str] | None:
        """The prompt as [template, content, template, content, ..., template], or None
        when the template does not copy each content verbatim exactly once."""
        nonce = secrets.token_hex(8)
        # Private-use characters around a random nonce: no client text can hold one by
        # chance, and a template has no reason to alter them.
        sentinels = [f"\ue000{nonce}:{index}\ue001" for index in range(len(messages))]
        rendered = self.apply_chat_template(
            [
                {**message, "content": sentinel}
                for message, sentinel in zip(messages, sentinels, strict=True)
            ],
            add_generation_prompt,
        )
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        # parts: template text, then (sentinel index, template text) pairs.
        order = [int(index) for index in parts[1::2]]
        if sorted(order) != list(range(len(messages))):
            return None
        pieces: list[str] = [parts[0]]
        for index, template_text in zip(order, parts[2::2], strict=True):
            pieces += [messages[index]["content"], template_text]
        # A template that transforms contents (trim, upper) still places sentinels
        # verbatim: only the real render shows whether the contents went in unchanged.
        if "".join(pieces) != self.apply_chat_template(messages, add_generation_prompt):
            return None
        return pieces

    def _split_at_special_tokens(self, text: str) -> list[str | int]:
        """``text`` as plain strings and special-token ids, matched the tokenizer's own way."""
        encoding = _encode_without_gil(self._tokenizer, text, add_special_tokens=False)
        parts: list[str | int] = []
        position = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self._special_token_ids:
                parts += [text[position:start], token_id]
                position = end
        parts.append(text[position:])
        return [part for part in parts if part != ""]

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        return _encode_without_gil(self._plain_tokenizer, text, add_special_tokens=False).ids

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; special tokens written in it become their single ids.

        ``add_special_tokens`` adds what the model's post-processor adds (a bos,
        say); a prompt from :meth:`apply_chat_template` already has its own.
        """
        return _encode_without_gil(self._tokenizer, text, add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; bytes of an unfinished UTF-8 character come out as U+FFFD."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None when absent."""
        return self._tokenizer.token_to_id(token)

    def min_num_tokens(self, texts: Iterable[str]) -> int:
        """At most the number of tokens of a prompt holding each of ``texts`` as
        disjoint parts (0 when this tokenizer has no bound)."""
        return 0 if self.token_bound is None else self.token_bound.min_num_tokens(texts)

    def _roles_written_out(self) -> frozenset[str]:
        """The roles of a probe conversation whose contents, less the whitespace
        around them (templates often trim), all appear in the rendered prompt;
        none when the template fails on it or drops one. A content's bytes then
        surely reach the tokenizer, so a chat's bound may count them."""
        nonce = secrets.token_hex(8)
        roles = ("system", "user", "assistant", "user")
        probe = [
            {"role": role, "content": f" probe-{nonce}-{index} "}
            for index, role in enumerate(roles)
        ]
        try:
            rendered = self.apply_chat_template(probe, add_generation_prompt=True)
        except ChatTemplateError:
            return frozenset()
        if all(message["content"].strip() in rendered for message in probe):
            return frozenset(roles)
        return frozenset()

    def _find_stop_token_ids(self) -> Iterable[int]:
        if self.eos_token_id is not None:
            yield self.eos_token_id
        for token in END_OF_TURN_TOKENS:
            token_id = self._tokenizer.token_to_id(token)
            # Only markers the template writes: a vocabulary can hold others unused.
            if token_id is not None and token in self._chat_template_source:
                yield token_id


def _encode_without_gil(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> Encoding:
    """``tokenizer.encode(text)``, letting other threads run meanwhile.

    The library's ``encode`` holds the GIL for the whole call, so a 100,000
    character prompt on a pool thread would still stall the event loop;
    ``encode_batch`` releases it while the Rust code works.
    """
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


class IncrementalDetokenizer:
    """Turn one request's generated token ids into text deltas, one token at a time.

    Decodes a small window of already-emitted tokens plus the new ones and emits
    the difference, so merges across token boundaries (byte-level BPE splitting a
    character over several tokens) come out right. Text is held back while it
    ends in U+FFFD, i.e. while a multi-byte character is still incomplete.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        context_tokens: int = 5,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = list(prompt_ids[-context_tokens:]) if context_tokens else []
        # [prefix_offset, read_offset): tokens already emitted, kept as decode context.
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the newly completed text (often "")."""
        self._token_ids.append(token_id)
        return self._emit(final=False)

    def finish(self) -> str:
        """Return whatever is held back; at the end of a stream it can only be U+FFFD."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        grew = len(full_text) > len(prefix_text)
        if grew and (final or not full_text.endswith(REPLACEMENT_CHARACTER)):
            # Keep only the newest tokens as context: decode cost stays constant per token.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            return full_text[len(prefix_text) :]
        if len(self._token_ids) - self._read_offset <= MAX_PENDING_TOKENS:
            return ""
        # Many tokens without text to send: skipped special tokens, or bytes that
        # are no character. Waiting longer would make every decode longer (a
        # stream of them would cost quadratic time), and it cannot help: a UTF-8
        # character still in progress has at most 3 bytes, so it lies within the
        # last 3 tokens (unless skipped special tokens sit between its bytes, which
        # no tokenizer writes). What comes before them is final.
        cut = len(self._token_ids) - MAX_INCOMPLETE_CHARACTER_BYTES
        cut_text = self._decode(self._token_ids[self._prefix_offset : cut])
        self._prefix_offset = self._read_offset
        self._read_offset = cut
        return cut_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def _compile_template(source: str) -> Any:
    """Compile like Hugging Face: sandboxed, trimmed blocks, loop controls."""

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(format_string: str) -> str:
        return datetime.now().strftime(format_string)

    def tojson(value: Any, indent: int | None = None) -> str:
        # jinja2's own tojson escapes HTML characters, which HF templates don't expect.
        return json.dumps(value, ensure_ascii=False, indent=indent)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(source)


def _chat_template_source(template: Any) -> str | None:
    """The default template, whether stored as a string or as HF's list of named ones."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    raise ModelDirectoryError(f"chat_template of unexpected type {type(template).__name__}")


def _token_content(token: Any) -> str | None:
    """A special token as stored in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _required_file(model_dir: Path, name: str) -> Path:
    path = model_dir / name
    if not path.is_file():
        raise ModelDirectoryError(f"model directory {model_dir} has no {name}")
    return path
