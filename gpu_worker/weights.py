"""Load a Llama-family checkpoint's safetensors into the engine's fused layout.

Q, K and V projections are concatenated into one matrix, and so are the
gate and up projections of the MLP, so each is one matmul over all tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_worker.model_config import ModelConfig, ModelLoadError
from gpu_worker.quantized_linear import PackedLinear
from gpu_worker.weight_share import WeightShare

# What a rank's ``ModelWeights`` has where its share lacks a tensor (the
# embeddings outside the first stage, the head outside the last).
NOT_HELD = torch.empty(0)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. A projection is a tensor, or packed by
    ``quantized_linear.pack_weights`` after loading."""

    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor | PackedLinear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o_proj: torch.Tensor | PackedLinear  # [hidden, heads * head_dim]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor | PackedLinear  # [2 * intermediate, hidden]
    down_proj: torch.Tensor | PackedLinear  # [hidden, intermediate]


@dataclass(frozen=True)
class ModelWeights:
    """The network, or a rank's share of it (``load_weights``)."""

    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor | PackedLinear  # [vocab, hidden]; the embedding itself when tied


class _Checkpoint:
    """Tensors by name across every *.safetensors file of a directory."""

    def __init__(self, model_dir: Path) -> None:
        self._files: dict[str, Path] = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self._files[name] = path
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)  # type: ignore[attr-defined]


def load_weights(
    model_dir: Path,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    share: WeightShare | None = None,
) -> ModelWeights:
    """Read, fuse, cut, cast and place the weights of ``share`` (default: the whole
    model). A layer is fused and cut on the host in the checkpoint's dtype, one at
    a time, before it reaches ``device``; what the share lacks is ``NOT_HELD``
    (its ``layers`` are the share's alone)."""
    share = share or WeightShare.whole(config)
    checkpoint = _Checkpoint(model_dir)
    read = checkpoint.get

    def place(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=device, dtype=dtype)

    layers = []
    for index in share.layers:
        prefix = f"model.layers.{index}."
        attention = prefix + "self_attn."
        qkv_bias = None
        if config.attention_bias or checkpoint.has(attention + "q_proj.bias"):
            qkv_bias = torch.cat([read(f"{attention}{p}_proj.bias") for p in "qkv"])
        whole = LayerWeights(
            input_norm=read(prefix + "input_layernorm.weight"),
            qkv_proj=torch.cat([read(f"{attention}{p}_proj.weight") for p in "qkv"]),
            qkv_bias=qkv_bias,
            o_proj=read(attention + "o_proj.weight"),
            post_attention_norm=read(prefix + "post_attention_layernorm.weight"),
            gate_up_proj=torch.cat(
                [read(prefix + "mlp.gate_proj.weight"), read(prefix + "mlp.up_proj.weight")]
            ),
            down_proj=read(prefix + "mlp.down_proj.weight"),
        )
        layers.append(_placed(share.cut(whole, config), place))
    embed_tokens = lm_head = final_norm = NOT_HELD
    tied = config.tie_word_embeddings or not checkpoint.has("lm_head.weight")
    if share.embeddings or (share.head and tied):
        embed_tokens = place(read("model.embed_tokens.weight"))
        expected = (config.vocab_size, config.hidden_size)
        if tuple(embed_tokens.shape) != expected:
            raise ModelLoadError(
                f"embedding shape {tuple(embed_tokens.shape)} does not match config {expected}"
            )
    if share.head:
        lm_head = embed_tokens if tied else place(read("lm_head.weight"))
        final_norm = place(read("model.norm.weight"))
    return ModelWeights(
        embed_tokens=embed_tokens if share.embeddings else NOT_HELD,
        layers=layers,
        final_norm=final_norm,
        lm_head=lm_head,
    )


def _placed(layer: LayerWeights, place: Callable[[torch.Tensor], torch.Tensor]) -> LayerWeights:
    """``layer`` with every tensor on the engine's device and dtype."""
    assert all(
        isinstance(matrix, torch.Tensor)
        for matrix in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ), "place before packing"
    return LayerWeights(
        input_norm=place(layer.input_norm),
        qkv_proj=place(layer.qkv_proj),  # type: ignore[arg-type]
        qkv_bias=None if layer.qkv_bias is None else place(layer.qkv_bias),
        o_proj=place(layer.o_proj),  # type: ignore[arg-type]
        post_attention_norm=place(layer.post_attention_norm),
        gate_up_proj=place(layer.gate_up_proj),  # type: ignore[arg-type]
        down_proj=place(layer.down_proj),  # type: ignore[arg-type]
    )


def weights_num_bytes(weights: ModelWeights, embeddings: bool = True) -> int:
    """Bytes the weights hold: every layer, the final norm and the LM head, plain or
    packed, and the embedding table unless ``embeddings`` is False (a decode step
    gathers a few of its rows); a tied head counts once."""
    parts: list[torch.Tensor | PackedLinear | None] = [weights.final_norm, weights.lm_head]
    if embeddings:
        parts.append(weights.embed_tokens)
    for layer in weights.layers:
        parts += [layer.input_norm, layer.qkv_proj, layer.qkv_bias, layer.o_proj]
        parts += [layer.post_attention_norm, layer.gate_up_proj, layer.down_proj]
    unique = {id(part): part for part in parts if part is not None}
    return sum(
        part.numel() * part.element_size() if isinstance(part, torch.Tensor) else part.num_bytes
        for part in unique.values()
    )


def checkpoint_digest(model_dir: Path) -> str:
    """A digest of a checkpoint that every rank of a group can take without reading
    its weights: each tensor's name, dtype and shape, and the final norm's values
    (another checkpoint of the same shapes differs there)."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in sorted(handle.keys()):
                part = handle.get_slice(name)
                digest.update(f"{name}:{part.get_dtype()}:{part.get_shape()};".encode())
    norm = _Checkpoint(model_dir).get("model.norm.weight")
    digest.update(norm.float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def random_weights(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> ModelWeights:
    """Weights of the right shapes with random values, for benchmarks of a config
    whose checkpoint is not on the machine (speed does not depend on the values)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, intermediate = config.hidden_size, config.intermediate_size
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim

    def normal(*shape: int) -> torch.Tensor:
        values = torch.randn(*shape, generator=generator) * (hidden**-0.5)
        return values.to(device=device, dtype=dtype)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, device=device, dtype=dtype)

    layers = [
        LayerWeights(
            input_norm=ones(hidden),
            qkv_proj=normal(qkv_rows, hidden),
            qkv_bias=normal(qkv_rows) if config.attention_bias else None,
            o_proj=normal(hidden, config.num_heads * config.head_dim),
            post_attention_norm=ones(hidden),
            gate_up_proj=normal(2 * intermediate, hidden),
            down_proj=normal(hidden, intermediate),
        )
        for _ in range(config.num_layers)
    ]
    embed_tokens = normal(config.vocab_size, hidden)
    lm_head = embed_tokens if config.tie_word_embeddings else normal(config.vocab_size, hidden)
    return ModelWeights(embed_tokens, layers, ones(hidden), lm_head)
