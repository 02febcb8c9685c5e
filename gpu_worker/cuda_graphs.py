"""CUDA graphs for decode-only steps: one replay instead of hundreds of kernel launches.

A decode step of a small model is a few hundred short kernels; launching them
from Python costs more CPU time than the GPU needs to run them. The runner
captures one graph per batch-size bucket, all reading static device buffers
(token ids, positions, slots, the request table of the Triton backend), and
a step copies its inputs into those buffers and replays the graph of the
smallest bucket that holds it.

Padding rows (bucket minus batch) are dummy requests: one token at position
0, K/V slot ``PADDING_SLOT`` (the Triton K/V writer skips it, so no block of
the pool is set aside for them), attending over slot 0 only; their logits are
dropped. Only the Triton backend is graph-safe here: its launches depend on
tensor shapes and constants alone, never on host values read per step.

``capture_graphs=False`` runs the same static-buffer forward eagerly: that
is how the CPU tests check the padding and buffers, and how a GPU user can
compare a graph against the same step without one.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention import AttentionBackend, SequenceLayout, decodes_within
from gpu_worker.attention_triton import (
    FIRST_BLOCK_COLUMN,
    NUM_CACHED_TOKENS,
    NUM_QUERY_TOKENS,
    QUERY_START,
    TritonAttention,
    TritonPlan,
    request_table,
)
from gpu_worker.block_tables import blocks_for
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.kv_write_triton import PADDING_SLOT
from gpu_worker.llama import LlamaModel

DECODE_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_ID, POSITION, SLOT = 0, 1, 2  # rows of the static token inputs


class GraphUnavailableError(RuntimeError):
    """CUDA graphs cannot be used with this device or backend."""


def bucket_for(batch_size: int, buckets: Sequence[int] = DECODE_BATCH_BUCKETS) -> int:
    """The smallest bucket (ascending ``buckets``) holding ``batch_size`` requests."""
    index = bisect.bisect_left(buckets, batch_size)
    if batch_size < 1 or index == len(buckets):
        raise ValueError(f"batch of {batch_size} fits no bucket of {list(buckets)}")
    return buckets[index]


@dataclass(frozen=True)
class PaddedDecodeStep:
    """A decode step padded to its bucket, as host arrays ready for the static buffers."""

    bucket: int
    num_requests: int
    token_inputs: np.ndarray  # [3, bucket] int64: token id, position, slot
    requests: np.ndarray  # [bucket, 3 + max_blocks of the step] int32: Triton request table


def pad_decode_step(
    token_ids: list[int],
    positions: list[int],
    slots: list[int],
    layout: list[SequenceLayout],
    buckets: Sequence[int] = DECODE_BATCH_BUCKETS,
) -> PaddedDecodeStep:
    """Pad one decode-only step (one new token per request) to its bucket with dummy rows."""
    num_requests = len(layout)
    if any(sequence.num_query_tokens != 1 for sequence in layout):
        raise ValueError("only decode-only steps (one new token per request) are padded")
    if not len(token_ids) == len(positions) == len(slots) == num_requests:
        raise ValueError("token_ids, positions and slots need one entry per request")
    bucket = bucket_for(num_requests, buckets)
    token_inputs = np.zeros((3, bucket), dtype=np.int64)
    token_inputs[TOKEN_ID, :num_requests] = token_ids
    token_inputs[POSITION, :num_requests] = positions
    token_inputs[SLOT, :num_requests] = slots
    token_inputs[SLOT, num_requests:] = PADDING_SLOT
    real = request_table(layout)
    requests = np.zeros((bucket, real.shape[1]), dtype=np.int32)
    requests[:num_requests] = real
    requests[num_requests:, QUERY_START] = np.arange(num_requests, bucket)
    requests[num_requests:, NUM_QUERY_TOKENS] = 1
    requests[num_requests:, NUM_CACHED_TOKENS] = 0
    return PaddedDecodeStep(bucket, num_requests, token_inputs, requests)


@dataclass(frozen=True)
class _CapturedStep:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] fp32, rewritten by every replay


def _graph_name(bucket: int) -> str:
    return f"cuda_graph[{bucket}]"


class DecodeGraphRunner:
    """Decode-only forwards on static buffers, one captured CUDA graph per batch bucket."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        buckets: Sequence[int] = DECODE_BATCH_BUCKETS,
        capture_graphs: bool = True,
    ) -> None:
        if not isinstance(backend, TritonAttention):
            raise GraphUnavailableError(
                f"CUDA graphs need the 'triton' attention backend, not {backend.name!r}"
            )
        if capture_graphs and model.device.type != "cuda":
            raise GraphUnavailableError(f"CUDA graphs need a CUDA device, not {model.device}")
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be ascending and positive, got {list(buckets)}")
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.buckets = tuple(buckets)
        max_bucket = self.buckets[-1]
        block_size = kv_cache.block_size
        self.max_blocks_per_request = min(
            kv_cache.num_blocks, blocks_for(model.config.max_position_embeddings, block_size)
        )
        device = model.device
        if kv_cache.num_blocks * block_size >= 2**31:
            raise GraphUnavailableError("the K/V pool has too many slots for int32 slot ids")
        # Every input that changes between steps lives in one int32 buffer, so a step
        # is one copy: token ids, positions and slots ([3, max_bucket]), then the
        # Triton request table ([max_bucket, 3 + max_blocks]). The host copy is
        # page-locked on CUDA, so the copy is asynchronous and the CPU goes straight on
        # to the replay.
        row_width = FIRST_BLOCK_COLUMN + self.max_blocks_per_request
        self._num_token_entries = 3 * max_bucket
        self._row_width = row_width
        host_inputs = torch.zeros(
            self._num_token_entries + max_bucket * row_width, dtype=torch.int32
        )
        pinned = device.type == "cuda"
        self._host_inputs = host_inputs.pin_memory() if pinned else host_inputs
        host_tokens, host_requests = self._split_inputs(self._host_inputs)
        self._host_tokens, self._host_requests = host_tokens.numpy(), host_requests.numpy()
        self._host_tokens[SLOT] = PADDING_SLOT
        self._host_requests[:, QUERY_START] = np.arange(max_bucket)
        self._host_requests[:, NUM_QUERY_TOKENS] = 1
        self._inputs = self._host_inputs.to(device, copy=True)
        self._token_inputs, self._requests = self._split_inputs(self._inputs)
        tiles = np.stack([np.arange(max_bucket), np.zeros(max_bucket)], axis=1).astype(np.int32)
        self._tiles = torch.from_numpy(tiles).to(device)  # [max_bucket, 2]: tile i = request i
        self._logits_rows = torch.arange(max_bucket, dtype=torch.int64, device=device)
        self._inputs_copied = torch.cuda.Event() if pinned else None
        self._captured: dict[int, _CapturedStep] = {}
        self._dropped: set[str] = set()
        if capture_graphs:
            self._capture()

    def _split_inputs(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the flat input buffer: token inputs [3, max_bucket] and the request
        table [max_bucket, row width]."""
        tokens = inputs[: self._num_token_entries].view(3, -1)
        requests = inputs[self._num_token_entries :].view(-1, self._row_width)
        return tokens, requests

    def graph_for(self, layout: list[SequenceLayout]) -> str | None:
        """``cuda_graph[bucket]`` where this decode-only step has a bucket and its block
        tables fit the buffers, else None (``step_path.py``)."""
        if not (
            1 <= len(layout) <= self.buckets[-1]
            and decodes_within(layout, self.max_blocks_per_request)
        ):
            return None
        name = _graph_name(bucket_for(len(layout), self.buckets))
        return None if name in self._dropped else name

    def graph_names(self) -> list[str]:
        """A graph per bucket still in use."""
        names = [_graph_name(bucket) for bucket in self.buckets]
        return [name for name in names if name not in self._dropped]

    def drop(self, name: str) -> None:
        """Run the steps of this bucket's graph eagerly from now on."""
        self._dropped.add(name)

    def size_ranges(self) -> list[tuple[int, int]]:
        """Each bucket's graph takes the sizes above the bucket below, up to its own."""
        lows = (1, *(bucket + 1 for bucket in self.buckets[:-1]))
        ranges = zip(lows, self.buckets, strict=True)
        return [(low, high) for low, high in ranges if _graph_name(high) not in self._dropped]

    def logit_tolerance(self, name: str) -> float | None:
        """A replay runs the eager step's own kernels: the probe's default bound."""
        return None

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        layout: list[SequenceLayout],
    ) -> torch.Tensor:
        """Logits (fp32) ``[len(layout), vocab]`` of a step with a ``graph_for`` it.

        The result is a view of the graph's output, valid until the next ``run``.
        """
        padded = pad_decode_step(token_ids, positions, slots, layout, self.buckets)
        bucket, width = padded.bucket, padded.requests.shape[1]
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()  # the last step's copy has read the staging
        self._host_tokens[:, :bucket] = padded.token_inputs
        self._host_requests[:bucket, :width] = padded.requests
        # Whole rows: one contiguous transfer. What lies beyond a row's blocks, or
        # beyond the bucket, is never read by this bucket's graph.
        num_entries = self._num_token_entries + bucket * self._row_width
        self._inputs[:num_entries].copy_(self._host_inputs[:num_entries], non_blocking=True)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        captured = self._captured.get(bucket)
        if captured is None:
            logits = self._forward(bucket)
        else:
            captured.graph.replay()
            logits = captured.logits
        return logits[: padded.num_requests]

    def _forward(self, bucket: int) -> torch.Tensor:
        """The decode forward of ``bucket`` rows, reading only the static buffers."""
        plan = TritonPlan(
            requests=self._requests[:bucket],
            tiles=self._tiles[:bucket],
            block_size=self.kv_cache.block_size,
            tile_tokens=1,
        )
        return self.model.forward(
            token_ids=self._token_inputs[TOKEN_ID, :bucket],
            positions=self._token_inputs[POSITION, :bucket],
            slot_mapping=self._token_inputs[SLOT, :bucket],
            kv_cache=self.kv_cache,
            backend=self.backend,
            attention_plan=plan,
            logits_rows=self._logits_rows[:bucket],
        )  # [bucket, vocab]

    def _capture(self) -> None:
        """Warm up every bucket (Triton compiles, cuBLAS picks kernels), then capture each.

        The buffers hold dummy rows only, so warm-up and capture write no K/V.
        Largest first, in one memory pool, so smaller graphs reuse its memory.
        """
        device = self.model.device
        side_stream = torch.cuda.Stream(device)
        side_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side_stream):
            for bucket in self.buckets:
                self._forward(bucket)
        torch.cuda.current_stream(device).wait_stream(side_stream)
        torch.cuda.synchronize(device)
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bucket)
            self._captured[bucket] = _CapturedStep(graph, logits)
        torch.cuda.synchronize(device)
