"""Tiny random-weight Llama-family checkpoints written by ``transformers``.

They have the real file layout (config.json, model.safetensors, tokenizer
files) and every architectural variant the loader must handle, at a size
that runs in milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY_VOCAB_SIZE = 96


def _write_tokenizer_files(model_dir: Path) -> None:
    # A character-level vocabulary is enough: these tests feed token ids.
    vocab = {f"<t{i}>": i for i in range(TINY_VOCAB_SIZE)}
    tokenizer = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": 2,
                "content": "<t2>",
                "special": True,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
            },
        ],
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<t0>"},
        "pre_tokenizer": {"type": "Whitespace"},
    }
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<t2>", "chat_template": "{{ messages[0]['content'] }}"})
    )


def write_tiny_model(model_dir: Path, variant: str = "llama", **overrides: Any) -> Path:
    """Save a random model of ``variant`` ('llama', 'qwen2', 'llama3_rope', 'untied')."""
    import transformers

    torch.manual_seed(1234)
    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    if variant == "qwen2":
        common.update(num_key_value_heads=1, rope_theta=1000000.0)
        common.update(overrides)
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        if variant == "llama3_rope":
            common["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        if variant == "untied":
            common.update(tie_word_embeddings=False, num_key_value_heads=4)
        common.update(overrides)
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    # Random init leaves norms at 1 and biases at 0; perturb them so a missed
    # weight shows up as a mismatch.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    _write_tokenizer_files(model_dir)
    return model_dir


def on_a_q8_0_grid(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] quantized as llama.cpp's Q8_0 and dequantized: per group of
    32, ``level * scale`` with level in -127..127 and an fp16 scale of max|w| / 127."""
    groups = weight.float().reshape(weight.shape[0], -1, 32)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    levels = (groups / scale.clamp_min(1e-30)).round().clamp(-127, 127)
    return (levels * scale).reshape(weight.shape)


def on_a_q4_1_grid(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] quantized as llama.cpp's Q4_1 and dequantized: per group of
    32, ``q * scale + minimum`` with q in 0..15 and fp16 scale and minimum."""
    groups = weight.float().reshape(weight.shape[0], -1, 32)
    minimum = groups.amin(dim=-1, keepdim=True).half().float()
    scale = ((groups.amax(dim=-1, keepdim=True) - minimum) / 15).half().float()
    levels = ((groups - minimum) / scale).round().clamp(0, 15)
    return (levels * scale + minimum).reshape(weight.shape)
