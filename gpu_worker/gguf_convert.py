"""Convert a llama-architecture GGUF file into a Hugging Face-format model directory.

Pure conversion, no policy: :func:`write_hf_model` fills a directory it is
given with ``config.json``, ``generation_config.json``, ``model.safetensors``
(fp32) and the tokenizer files. Where that directory lives, atomicity and
idempotency are :mod:`gpu_worker.model_prepare`'s business.

Two things in a GGUF differ from Hugging Face's layout:

- GGUF lists tensor dimensions fastest-first, the reverse of torch; the
  dequantized numpy array, though, already comes back in torch order.
- llama.cpp's converter permuted the rows of Q and K so each head's rotary
  pairs are interleaved (GPT-J style); Hugging Face's Llama rotates halves,
  so the permutation is undone here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# Bump when the output for the same GGUF changes, so old prepared dirs are redone.
CONVERTER_VERSION = 1

# token_type values in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# GGUF per-layer tensor name -> Hugging Face name, "{i}" being the layer index.
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class GGUFConversionError(ValueError):
    """The GGUF file is not a llama model this converter understands."""


@dataclass(frozen=True)
class LlamaShape:
    """The architecture numbers read from a GGUF's ``llama.*`` metadata."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Memory-map a GGUF file and check it is a llama-architecture model."""
    reader = gguf.GGUFReader(path)
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise GGUFConversionError(f"{path}: architecture {architecture!r}, expected 'llama'")
    return reader


def llama_shape(reader: gguf.GGUFReader) -> LlamaShape:
    """Read the model's dimensions from the GGUF metadata."""
    hidden_size = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    return LlamaShape(
        hidden_size=hidden_size,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden_size // num_heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        vocab_size=len(_field(reader, "tokenizer.ggml.tokens")),
    )


def hf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The ``config.json`` of the equivalent ``LlamaForCausalLM``."""
    shape = llama_shape(reader)
    tensor_names = {tensor.name for tensor in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        # llama.cpp drops output.weight when it equals the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _optional_int(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _optional_int(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _optional_int(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def hf_generation_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The ``generation_config.json``: just the special token ids."""
    return {
        "bos_token_id": _optional_int(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _optional_int(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _optional_int(reader, "tokenizer.ggml.padding_token_id"),
    }


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``permute`` in ``convert_hf_to_gguf.py``).

    llama.cpp reshaped rows as ``[heads, 2, head_dim/2]`` and swapped the last
    two axes; this reshapes as ``[heads, head_dim/2, 2]`` and swaps back.
    """
    # weight: [num_heads * head_dim, hidden_size]
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def hf_tensors(reader: gguf.GGUFReader) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, fp32 array in torch layout)`` for every tensor in the file."""
    shape = llama_shape(reader)
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name)
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF dims are fastest-first; numpy (and torch) want slowest-first.
        expected = tuple(int(n) for n in reversed(tensor.shape))
        if array.shape != expected:
            raise GGUFConversionError(f"{tensor.name}: dequantized {array.shape}, want {expected}")
        if hf_name.endswith("q_proj.weight"):
            array = unpermute_rotary(array, shape.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = unpermute_rotary(array, shape.num_key_value_heads)
        # Copy: the F32 path returns a view into the memory-mapped file.
        yield hf_name, np.array(array, dtype=np.float32, order="C", copy=True)


def hf_tensor_name(gguf_name: str) -> str:
    """Map ``blk.3.attn_q.weight`` to ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_TENSOR_NAMES[parts[2]]}.{suffix}"
    if stem in _GLOBAL_TENSOR_NAMES:
        return f"{_GLOBAL_TENSOR_NAMES[stem]}.{suffix}"
    raise GGUFConversionError(f"unknown GGUF tensor {gguf_name!r}")


def build_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from the ``tokenizer.ggml.*`` metadata."""
    tokenizer_model = _field(reader, "tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise GGUFConversionError(f"tokenizer model {tokenizer_model!r}, only 'gpt2' (BPE)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(_field(reader, "tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    if _field(reader, "tokenizer.ggml.add_bos_token", False):
        bos = tokens[int(_field(reader, "tokenizer.ggml.bos_token_id"))]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        # What Hugging Face's byte-level tokenizers use: offsets only, no tokens added.
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens must be matched whole in text, never split by BPE.
    added = [
        AddedToken(tokens[i], special=token_type == _TOKEN_TYPE_CONTROL, normalized=False)
        for i, token_type in enumerate(token_types)
        if token_type in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_special_tokens([token for token in added if token.special])
    tokenizer.add_tokens([token for token in added if not token.special])
    return tokenizer


def hf_tokenizer_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The ``tokenizer_config.json``: chat template, special token strings, bos policy."""
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")

    def token_string(key: str) -> str | None:
        token_id = _optional_int(reader, key)
        return None if token_id is None else tokens[token_id]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "bos_token": token_string("tokenizer.ggml.bos_token_id"),
        "eos_token": token_string("tokenizer.ggml.eos_token_id"),
        "unk_token": token_string("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_string("tokenizer.ggml.padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length")),
    }
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = str(template)
    return config


def hf_special_tokens_map(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """The ``special_tokens_map.json`` derived from the tokenizer config."""
    keys = ("bos_token", "eos_token", "unk_token", "pad_token")
    return {key: tokenizer_config[key] for key in keys if tokenizer_config.get(key) is not None}


def write_tokenizer_files(reader: gguf.GGUFReader, out_dir: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    build_tokenizer(reader).save(str(out_dir / "tokenizer.json"))
    tokenizer_config = hf_tokenizer_config(reader)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", hf_special_tokens_map(tokenizer_config))


def write_hf_model(
    reader: gguf.GGUFReader,
    out_dir: Path,
    on_tensor: Callable[[str], None] = lambda name: None,
) -> None:
    """Write the whole Hugging Face model directory into the existing ``out_dir``.

    ``on_tensor`` is called after each tensor is converted (for a progress bar).
    """
    _write_json(out_dir / "config.json", hf_config(reader))
    _write_json(out_dir / "generation_config.json", hf_generation_config(reader))
    write_tokenizer_files(reader, out_dir)
    tensors: dict[str, np.ndarray] = {}
    for name, array in hf_tensors(reader):
        tensors[name] = array
        on_tensor(name)
    # transformers refuses safetensors files without format "pt".
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer named by ``tokenizer.ggml.pre``.

    Only the ones whose Hugging Face original is known are supported: a wrong
    pre-tokenizer silently yields different token ids, which is worse than failing.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM2's own tokenizer.json: every digit is its own pre-token.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt-2", "default"):
        return byte_level
    raise GGUFConversionError(f"unsupported tokenizer.ggml.pre {pre!r}")


_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise GGUFConversionError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _optional_int(reader: gguf.GGUFReader, key: str) -> int | None:
    value = _field(reader, key, None)
    return None if value is None else int(value)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
