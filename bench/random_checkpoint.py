"""Write random weights into a model folder that has a config and a tokenizer but no weights.

    python -m bench.random_checkpoint MODEL_DIR [--dtype bfloat16] [--seed 0]

For end-to-end speed runs on a machine that cannot hold the real checkpoint (the
GPU machine takes 64 MiB of files, SmolLM2's weights are 270 MB): a step's time
does not depend on the values. ``MODEL_DIR`` needs ``config.json`` and the tokenizer
files; ``model.safetensors`` is written with the tensor names and shapes a
Hugging Face Llama checkpoint of that config has, so the worker loads it as usual.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu_worker.model_config import ModelConfig, load_model_config


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Llama checkpoint of ``config``, by name."""
    hidden, head_dim = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}."
        projections = {
            "self_attn.q_proj": config.num_heads * head_dim,
            "self_attn.k_proj": config.num_kv_heads * head_dim,
            "self_attn.v_proj": config.num_kv_heads * head_dim,
        }
        for name, rows in projections.items():
            shapes[f"{prefix}{name}.weight"] = (rows, hidden)
            if config.attention_bias:
                shapes[f"{prefix}{name}.bias"] = (rows,)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, config.num_heads * head_dim)
        shapes[prefix + "mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, config.intermediate_size)
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
    return shapes


def random_checkpoint(
    config: ModelConfig, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Norms of ones, everything else normal with std hidden**-0.5."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            values = torch.randn(shape, generator=generator) * config.hidden_size**-0.5
            tensors[name] = values.to(dtype)
    return tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = load_model_config(args.model_dir, with_weights=False)
    tensors = random_checkpoint(config, getattr(torch, args.dtype), args.seed)
    out = args.model_dir / "model.safetensors"
    save_file(tensors, str(out), metadata={"format": "pt", "weights": "random"})
    num_params = sum(t.numel() for t in tensors.values())
    print(f"wrote {out}: {num_params / 1e6:.1f}M random parameters ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
