"""A tensor-parallel rank's share of a layer (Megatron's split): the column-parallel
products of the ranks put together, and the row-parallel partial sums added up,
are the whole layer's; a model whose heads the ranks cannot split is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.model_config import load_model_config
from gpu_worker.pipeline_layout import GroupConfigError
from gpu_worker.tensor_shard import check_tensor_parallel, shard_config, shard_layer
from gpu_worker.weights import load_weights
from tests.gpu_worker.tiny_models import write_tiny_model


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_the_ranks_shares_make_up_the_whole_layer(tmp_path: Path, variant: str) -> None:
    # Qwen2 has biases on Q, K and V: they split with their rows.
    model_dir = write_tiny_model(tmp_path / variant, variant, num_key_value_heads=2)
    config = load_model_config(model_dir)
    [layer, *_] = load_weights(model_dir, config, torch.device("cpu"), torch.float32).layers
    ranks = 2
    shards = [shard_layer(layer, config, ranks, rank) for rank in range(ranks)]
    shape = shard_config(config, ranks)
    x = torch.randn(5, config.hidden_size, dtype=torch.float64)
    d = config.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    whole_qkv = x @ layer.qkv_proj.double().T  # type: ignore[union-attr]
    if layer.qkv_bias is not None:
        whole_qkv += layer.qkv_bias.double()
    parts = []
    for shard in shards:
        part = x @ shard.qkv_proj.double().T  # type: ignore[union-attr]
        if shard.qkv_bias is not None:
            part += shard.qkv_bias.double()
        parts.append(part.split([q, kv, kv], dim=-1))
    # Each rank's queries, keys and values are its heads' columns of the whole.
    for index in range(3):
        put_together = torch.cat([part[index] for part in parts], dim=-1)
        q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
        start = [0, q_size, q_size + kv_size][index]
        size = [q_size, kv_size, kv_size][index]
        torch.testing.assert_close(put_together, whole_qkv[:, start : start + size])
    # Row-parallel: the ranks' partial products add up to the whole one.
    attended = torch.randn(5, config.num_heads * d, dtype=torch.float64)
    partial = [
        attended[:, rank * q : (rank + 1) * q] @ shard.o_proj.double().T  # type: ignore[union-attr]
        for rank, shard in enumerate(shards)
    ]
    torch.testing.assert_close(sum(partial), attended @ layer.o_proj.double().T)  # type: ignore[union-attr]
    units = shape.intermediate_size
    gate_up = [x @ shard.gate_up_proj.double().T for shard in shards]  # type: ignore[union-attr]
    whole = x @ layer.gate_up_proj.double().T  # type: ignore[union-attr]
    gates = torch.cat([part[:, :units] for part in gate_up], dim=-1)
    ups = torch.cat([part[:, units:] for part in gate_up], dim=-1)
    torch.testing.assert_close(gates, whole[:, : config.intermediate_size])
    torch.testing.assert_close(ups, whole[:, config.intermediate_size :])
    hidden = torch.randn(5, config.intermediate_size, dtype=torch.float64)
    down = [
        hidden[:, rank * units : (rank + 1) * units] @ shard.down_proj.double().T  # type: ignore[union-attr]
        for rank, shard in enumerate(shards)
    ]
    torch.testing.assert_close(sum(down), hidden @ layer.down_proj.double().T)  # type: ignore[union-attr]


def test_smollm2_takes_three_ranks_and_refuses_two(prepared_model_dir: Path) -> None:
    config = load_model_config(prepared_model_dir)
    check_tensor_parallel(config, 3)
    assert shard_config(config, 3).num_heads == 3 and shard_config(config, 3).num_kv_heads == 1
    with pytest.raises(GroupConfigError, match="does not divide the model's 9 attention heads, "
                       "3 K/V heads"):  # fmt: skip
        check_tensor_parallel(config, 2)
    for bad in (0, -1):
        with pytest.raises(GroupConfigError, match="at least 1"):
            check_tensor_parallel(config, bad)
