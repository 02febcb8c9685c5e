"""A worker group rank reads only its share of a checkpoint (``weight_share.py``):
its stage's layers cut to its tensor rank's part, the embeddings in the first
stage, the final norm and LM head where it samples; the share is exactly that
part of the whole model, its packed form is probed by its own products, and
every rank can fingerprint the checkpoint without reading its weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.model_config import ModelLoadError, load_model_config
from gpu_worker.model_loading import load_model
from gpu_worker.quantized_linear import weight_format_of
from gpu_worker.tensor_shard import shard_layer
from gpu_worker.weight_share import WeightShare
from gpu_worker.weights import NOT_HELD, checkpoint_digest, load_weights, weights_num_bytes
from gpu_worker.worker_group import rank_share
from shared.settings import RedisSettings, WorkerSettings, model_location
from tests.gpu_worker.tiny_models import write_tiny_model

CPU = torch.device("cpu")


def _settings(model_dir: Path, pipeline: int, tensor: int) -> WorkerSettings:
    return WorkerSettings(
        redis=RedisSettings(url="redis://127.0.0.1:1"),
        model=model_location(model_dir=str(model_dir)),
        worker_id="w-share",
        pipeline_parallel=pipeline,
        tensor_parallel=tensor,
    )


def _without(model_dir: Path, prefix: str) -> None:
    """Drop every tensor whose name starts with ``prefix`` from the checkpoint."""
    [path] = model_dir.glob("*.safetensors")
    tensors = load_file(str(path))
    save_file({k: v for k, v in tensors.items() if not k.startswith(prefix)}, str(path))


def test_a_rank_reads_nothing_outside_its_share(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny", num_hidden_layers=4)
    config = load_model_config(model_dir)
    _without(model_dir, "model.layers.0.")  # the first stage's layer, gone
    second_stage = WeightShare(range(2, 4), embeddings=False, head=True)
    weights = load_weights(model_dir, config, CPU, torch.float32, second_stage)
    assert len(weights.layers) == 2
    assert weights.embed_tokens is NOT_HELD and weights.lm_head.shape[0] == config.vocab_size
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\."):
        load_weights(model_dir, config, CPU, torch.float32)  # the whole model needs it
    _without(model_dir, "model.norm.")
    first_stage = WeightShare(range(1, 2), embeddings=True, head=False)
    weights = load_weights(model_dir, config, CPU, torch.float32, first_stage)
    assert weights.final_norm is NOT_HELD and weights.lm_head is NOT_HELD


@pytest.mark.parametrize("variant", ["llama", "qwen2", "untied"])
def test_each_ranks_share_is_that_part_of_the_whole_model(tmp_path: Path, variant: str) -> None:
    model_dir = write_tiny_model(tmp_path / variant, variant, num_hidden_layers=4)
    config = load_model_config(model_dir)
    whole = load_weights(model_dir, config, CPU, torch.float32)
    settings = _settings(model_dir, pipeline=2, tensor=1 if variant == "qwen2" else 2)
    tensor_parallel = settings.tensor_parallel
    for rank in range(2 * tensor_parallel):
        share = rank_share(config, settings, rank)
        stage, tensor_rank = divmod(rank, tensor_parallel)
        assert share.layers == range(2 * stage, 2 * stage + 2)
        assert share.embeddings == (stage == 0)
        assert share.head == (stage == 1 and tensor_rank == 0)
        part = load_weights(model_dir, config, CPU, torch.float32, share)
        for index, layer in zip(share.layers, part.layers, strict=True):
            expected = shard_layer(whole.layers[index], config, tensor_parallel, tensor_rank)
            for name in ("qkv_proj", "qkv_bias", "o_proj", "gate_up_proj", "down_proj"):
                got, want = getattr(layer, name), getattr(expected, name)
                assert (got is None and want is None) or torch.equal(got, want), name
            assert torch.equal(layer.input_norm, whole.layers[index].input_norm)
        if share.embeddings:
            assert torch.equal(part.embed_tokens, whole.embed_tokens)
        if share.head:
            assert torch.equal(part.lm_head, whole.lm_head)
            assert torch.equal(part.final_norm, whole.final_norm)
        shape = share.config(config)
        assert shape.num_layers == 2
        assert shape.num_heads == config.num_heads // tensor_parallel


def test_a_packed_share_is_probed_by_its_products(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny", num_hidden_layers=4)
    share = WeightShare(range(2, 4), embeddings=False, head=True, tensor_parallel=2)
    model = load_model(model_dir, "cpu", "float32", "float16", share)
    assert weight_format_of(model.weights) == "float16"
    assert model.config.num_layers == 2 and model.config.num_heads == 2
    # The same share unpacked: the exact path.
    exact = load_model(model_dir, "cpu", "float32", "float32", share)
    assert isinstance(exact.weights.layers[0].qkv_proj, torch.Tensor)


def test_every_rank_fingerprints_the_checkpoint_without_its_weights(tmp_path: Path) -> None:
    first = write_tiny_model(tmp_path / "a")
    same = write_tiny_model(tmp_path / "b")
    assert checkpoint_digest(first) == checkpoint_digest(same)
    [path] = same.glob("*.safetensors")
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5  # a fine-tune
    save_file(tensors, str(path))
    assert checkpoint_digest(first) != checkpoint_digest(same)


def test_a_shares_bytes_are_its_tensors_and_a_tied_head_counts_once(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny", num_hidden_layers=4)
    config = load_model_config(model_dir)
    whole = load_weights(model_dir, config, CPU, torch.float32)
    [path] = model_dir.glob("*.safetensors")
    # Every checkpoint tensor once (the head is the embedding), in fp32.
    assert weights_num_bytes(whole) == sum(t.numel() * 4 for t in load_file(str(path)).values())
    first = load_weights(model_dir, config, CPU, torch.float32, WeightShare(range(2), True, False))
    embedding = config.vocab_size * config.hidden_size * 4
    assert weights_num_bytes(first, embeddings=False) == weights_num_bytes(first) - embedding
