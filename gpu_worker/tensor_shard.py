"""One tensor-parallel rank's share of a stage's layers (Megatron's split, pure).

Of T ranks, rank t keeps the attention heads ``[t H/T, (t+1) H/T)`` and the
K/V heads ``[t K/T, (t+1) K/T)``: the rows of the fused Q/K/V matrix (and
bias) that make them, and the columns of the output projection that read
them (column-parallel, then row-parallel); and the MLP's intermediate units
``[t I/T, (t+1) I/T)``: those rows of the fused gate/up matrix and those
columns of the down projection. Each row-parallel product is then a partial
sum, which the ranks add up with one all-reduce (``LlamaModel.run_layers``'s
``reduce_partial``). Norms, embeddings and the LM head stay whole on every
rank. A model whose heads, K/V heads or intermediate size T does not divide
is refused (``check_tensor_parallel``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from gpu_worker.model_config import ModelConfig
from gpu_worker.pipeline_layout import GroupConfigError

if TYPE_CHECKING:
    from gpu_worker.weights import LayerWeights


def check_tensor_parallel(config: ModelConfig, tensor_parallel: int) -> None:
    """GroupConfigError where ``tensor_parallel`` ranks cannot split this model."""
    if tensor_parallel < 1:
        raise GroupConfigError(f"--tensor-parallel must be at least 1, got {tensor_parallel}")
    sizes = {
        "attention heads": config.num_heads,
        "K/V heads": config.num_kv_heads,
        "intermediate size": config.intermediate_size,
    }
    indivisible = {name: size for name, size in sizes.items() if size % tensor_parallel}
    if indivisible:
        named = ", ".join(f"{size} {name}" for name, size in indivisible.items())
        raise GroupConfigError(
            f"--tensor-parallel {tensor_parallel} does not divide the model's {named}: "
            "it must divide its attention heads, K/V heads and intermediate size "
            f"({config.num_heads}, {config.num_kv_heads}, {config.intermediate_size})"
        )


def shard_config(config: ModelConfig, tensor_parallel: int) -> ModelConfig:
    """The shape one rank computes: its heads, K/V heads and intermediate units."""
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tensor_parallel,
        num_kv_heads=config.num_kv_heads // tensor_parallel,
        intermediate_size=config.intermediate_size // tensor_parallel,
    )


def _part(tensor: torch.Tensor, start: int, size: int, rank: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s ``size``-long slice of ``tensor[start:]`` along ``dim`` (a copy)."""
    return tensor.narrow(dim, start + rank * size, size).clone()


def shard_layer(
    layer: LayerWeights, config: ModelConfig, tensor_parallel: int, rank: int
) -> LayerWeights:
    """Rank ``rank``'s share of one layer of loaded (unpacked) weights."""
    head_dim, num_heads, num_kv_heads = config.head_dim, config.num_heads, config.num_kv_heads
    q_part = num_heads // tensor_parallel * head_dim
    kv_part = num_kv_heads // tensor_parallel * head_dim
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    intermediate = config.intermediate_size
    mlp_part = intermediate // tensor_parallel

    def qkv_rows(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                _part(tensor, 0, q_part, rank),
                _part(tensor, q_size, kv_part, rank),
                _part(tensor, q_size + kv_size, kv_part, rank),
            ]
        )

    assert isinstance(layer.qkv_proj, torch.Tensor), "shard before packing"
    assert isinstance(layer.o_proj, torch.Tensor) and isinstance(layer.down_proj, torch.Tensor)
    assert isinstance(layer.gate_up_proj, torch.Tensor)
    return dataclasses.replace(
        layer,
        qkv_proj=qkv_rows(layer.qkv_proj),
        qkv_bias=None if layer.qkv_bias is None else qkv_rows(layer.qkv_bias),
        o_proj=_part(layer.o_proj, 0, q_part, rank, dim=1),
        gate_up_proj=torch.cat(
            [
                _part(layer.gate_up_proj, 0, mlp_part, rank),
                _part(layer.gate_up_proj, intermediate, mlp_part, rank),
            ]
        ),
        down_proj=_part(layer.down_proj, 0, mlp_part, rank, dim=1),
    )
