"""Decode CUDA graphs: buckets, padding and the static-buffer forward, on the CPU.

Capturing and replaying a graph needs a GPU and is not tested here; what a
graph replays is: ``DecodeGraphRunner(capture_graphs=False)`` runs the very
same forward over the very same static buffers eagerly, under Triton's
interpreter (see test_attention_triton.py).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import random

import pytest
import torch
import triton  # noqa: F401  (a test dependency: the kernels need it)

from gpu_worker.attention import SequenceLayout, make_backend
from gpu_worker.cuda_graphs import (
    DECODE_BATCH_BUCKETS,
    POSITION,
    SLOT,
    TOKEN_ID,
    DecodeGraphRunner,
    GraphUnavailableError,
    bucket_for,
    pad_decode_step,
)
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget, PagedKVCache
from gpu_worker.kv_write_triton import PADDING_SLOT
from gpu_worker.llama import LlamaModel
from gpu_worker.model_loading import load_model
from gpu_worker.pointwise import make_pointwise
from tests.gpu_worker.tiny_models import TINY_VOCAB_SIZE, write_tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(model_dir, device="cpu", dtype="float32")


@pytest.mark.parametrize(
    ("batch_size", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (64, 64), (65, 128), (256, 256)]
)
def test_bucket_is_the_smallest_that_holds_the_batch(batch_size, bucket):
    assert bucket_for(batch_size) == bucket


@pytest.mark.parametrize("batch_size", [0, 257])
def test_batches_outside_the_buckets_are_rejected(batch_size):
    with pytest.raises(ValueError, match="fits no bucket"):
        bucket_for(batch_size, DECODE_BATCH_BUCKETS)


def test_padding_rows_are_dummy_requests_that_write_no_kv():
    layout = [
        SequenceLayout(query_start=0, num_query_tokens=1, num_cached_tokens=5, block_table=[3, 9]),
        SequenceLayout(query_start=1, num_query_tokens=1, num_cached_tokens=0, block_table=[4]),
        SequenceLayout(query_start=2, num_query_tokens=1, num_cached_tokens=2, block_table=[1]),
    ]
    padded = pad_decode_step([11, 12, 13], [5, 0, 2], [38, 16, 6], layout)
    assert (padded.bucket, padded.num_requests) == (4, 3)
    assert padded.token_inputs[TOKEN_ID].tolist() == [11, 12, 13, 0]
    assert padded.token_inputs[POSITION].tolist() == [5, 0, 2, 0]
    assert padded.token_inputs[SLOT].tolist() == [38, 16, 6, PADDING_SLOT]
    assert padded.requests.tolist() == [
        [0, 1, 5, 3, 9],
        [1, 1, 0, 4, 0],
        [2, 1, 2, 1, 0],
        [3, 1, 0, 0, 0],  # its own query row, one token, attends slot 0 only
    ]


def test_only_decode_steps_are_padded():
    layout = [SequenceLayout(0, 2, 0, [0])]
    with pytest.raises(ValueError, match="decode-only"):
        pad_decode_step([1, 2], [0, 1], [0, 1], layout)


def test_graphs_need_cuda_and_the_triton_backend(model):
    cache = PagedKVCache(model.config, 8, 4, CPU, model.dtype)
    with pytest.raises(GraphUnavailableError, match="CUDA device"):
        DecodeGraphRunner(model, cache, make_backend("triton", model.dtype))
    with pytest.raises(GraphUnavailableError, match="'triton' attention backend"):
        DecodeGraphRunner(model, cache, make_backend("cpu", model.dtype), capture_graphs=False)


def test_engine_ignores_cuda_graphs_on_the_cpu(model):
    engine = Engine(
        model, KVCacheBudget(num_bytes=1 << 20, block_size=4), "cpu", use_cuda_graphs=True
    )
    assert not engine.uses_cuda_graphs


@pytest.mark.parametrize("pointwise", ["torch", "triton"])
def test_static_buffer_decode_matches_the_eager_step(model, pointwise):
    """What a graph replays: padded static buffers (int32, one copy) give the eager
    forward's logits, write exactly the real rows' K/V, and leave the buffers ready for a
    smaller batch; with either pointwise ops (the Triton ones are the CUDA default)."""
    model = LlamaModel(model.config, model.weights, CPU, model.dtype, make_pointwise(pointwise))
    rng = random.Random(0)
    block_size, num_blocks = 4, 48
    backend = make_backend("triton", model.dtype)
    cache = PagedKVCache(model.config, num_blocks, block_size, CPU, model.dtype)
    # Random cached K/V, as if earlier steps had run.
    generator = torch.Generator().manual_seed(0)
    for layer_keys, layer_values in zip(cache.keys, cache.values, strict=True):
        layer_keys.copy_(torch.randn(layer_keys.shape, generator=generator))
        layer_values.copy_(torch.randn(layer_values.shape, generator=generator))
    runner = DecodeGraphRunner(model, cache, backend, buckets=(2, 8), capture_graphs=False)
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    for batch_size in (5, 2):  # bucket 8 with 3 padding rows, then bucket 2 exactly
        layout, token_ids, positions, slots = [], [], [], []
        for row in range(batch_size):
            num_cached = rng.randrange(0, 20)
            table = [free_blocks.pop() for _ in range(num_cached // block_size + 1)]
            layout.append(SequenceLayout(row, 1, num_cached, table))
            token_ids.append(rng.randrange(3, TINY_VOCAB_SIZE))
            positions.append(num_cached)
            slots.append(table[num_cached // block_size] * block_size + num_cached % block_size)
        assert runner.graph_for(layout) is not None
        before_keys = torch.stack(cache.keys)
        logits = runner.run(token_ids, positions, slots, layout).clone()
        changed = torch.stack(cache.keys) != before_keys  # [layers, slots, kv_heads, head_dim]
        written = changed.any(-1).any(-1).any(0).nonzero().flatten()
        assert sorted(written.tolist()) == sorted(slots), "padding rows must not write K/V"
        expected = model.forward(
            token_ids=torch.tensor(token_ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            kv_cache=cache,
            backend=backend,
            attention_plan=backend.prepare(layout, block_size, CPU),
            logits_rows=torch.arange(batch_size),
        )
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert None is runner.graph_for([SequenceLayout(row, 1, 0, [0]) for row in range(9)])
    assert None is runner.graph_for([SequenceLayout(0, 2, 0, [0])])
