"""Decode-only steps on the CPU as compiled graphs (torch.compile, inductor).

On the CPU, a decode step of a small model is mostly the host's work between
ops: SmolLM2's step is about 1,300 torch calls from Python, a few
microseconds each, around 6 ms of matmuls at one request. Inductor traces the
model's own forward (``final_hidden`` and ``logits``; only ``final_hidden``
where the LM head is an fbgemm object alone, or for batches, and the head
then runs after the graph), fuses the norms, RoPE, SwiGLU and residual adds
into a few C++ loops per layer and calls the matmul and attention kernels
from one generated function (an LM head on a Q8_0 grid, as the packaged
model's, is one such loop over its int8 form in the lone graph on AVX-512
CPUs, ``Int8GroupLinear``; on AVX2 ones ``q4_1``'s head is the kernel's Q8_0
op, which the graph calls): the CPU's counterpart of the CUDA graphs in
``cuda_graphs.py``.

``CompiledDecode`` keeps one graph for a lone request (a chat) and, where the
layers allow, one per range of batch sizes (``batch_ranges``: int4's matrices
change kernel above INT4_MAX_ROWS rows, so a graph each side). Their inputs
are the tokens, their positions and slots, and the requests' block ids, so
the number of blocks is a dynamic size of every graph and the number of
requests of the batch graphs (``GraphDecodeAttention`` gathers the blocks and
masks the slots past each position: ``decode_attention.py``, traced once as
a nested compile region and reused by all 30 layers, which halves the
batch graphs' compile). Because the runner only calls a graph with what it
was traced for (``fits``), the graphs run without dynamo's guards, whose
checks over hundreds of weight tensors cost most of a millisecond a call.

Compiling takes tens of seconds a graph on two cores the first time
(inductor keeps its results in ``TORCHINDUCTOR_CACHE_DIR``; a restart takes a
few). It is done once, when the runner is built, and each graph is checked
against the eager forward on a warm-up step; where the lone graph cannot be
made (no C++ compiler, an op inductor cannot trace) or its logits stray,
``DecodeCompileError`` says why and the engine keeps the eager forward; a
batch graph that cannot be made is left out with a log line, and those
batches run eagerly.
"""

from __future__ import annotations

import os
import time

import structlog
import torch

from gpu_worker.attention import SequenceLayout, decodes_within
from gpu_worker.block_tables import blocks_for
from gpu_worker.decode_attention import (
    MIN_BLOCKS,
    DecodeInputs,
    decode_inputs,
    paged_decode_attention,
    pool_blocks,
)
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.llama import LlamaModel
from gpu_worker.quantized_linear import (
    BF16_LOGIT_ERROR,
    PackedLinear,
    traceable,
    traceable_for_batches,
    weight_format_of,
)
from gpu_worker.unguarded_compile import UnguardedGraph, max_relative_error

# The largest batch the batch graph takes (a bound dynamo's shape reasoning needs).
BATCH_MAX_REQUESTS = 4096
# How far the compiled step's logits may stray from the eager forward's on the
# warm-up step, relative to the largest logit (fused loops round differently).
MAX_LOGIT_ERROR = 1e-3

_log = structlog.get_logger(__name__)
# Traced once per graph and stamped out for every layer (inductor's codegen of the
# attention, with its dynamic sizes, was half of a batch graph's compile: 109 s
# against 79 s for SmolLM2's int4 graph of 2 to 8 requests on two cores).
_ATTENTION_REGION = torch.compiler.nested_compile_region(paged_decode_attention)

# What the graph is: the forward, or the forward up to the LM head where the head
# is only fbgemm's packed object, which the tracer cannot enter (it then runs
# after the graph); without their inference_mode decorators: the graph is traced
# and run under no_grad (inductor fails on some graphs that mutate the K/V pool
# in inference mode: "Cannot set version_counter for inference tensor").
_UNDECORATED_FINAL_HIDDEN = LlamaModel.final_hidden.__wrapped__  # type: ignore[attr-defined]
_UNDECORATED_LOGITS = LlamaModel.logits.__wrapped__  # type: ignore[attr-defined]


class DecodeCompileError(RuntimeError):
    """The decode step cannot be compiled here, or its result strays; the eager forward runs."""


class GraphDecodeAttention:
    """Each request's one new query over its blocks, gathered by id, inside a graph."""

    name = "compiled-decode"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(
        self, layout: list[SequenceLayout], block_size: int, device: torch.device
    ) -> DecodeInputs:
        """The decodes' padded block tables and positions (``decode_inputs``)."""
        return decode_inputs(layout, device)

    def write_kv(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """``index_put_``, which inductor updates in place (its ``index_copy_``
        copies the whole pool)."""
        keys.index_put_((slot_mapping,), key)
        values.index_put_((slot_mapping,), value)

    def attend(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prepared: object
    ) -> torch.Tensor:
        """``queries`` [requests, heads, head_dim] -> the same: the paged decode
        attention, which inductor fuses with the gather of the blocks into a few loops
        reading the requests' keys and values where they lie (SDPA's kernel cost tens
        of microseconds a layer at one query, on blocks copied for it: a token 10 %
        faster at 128 tokens of context, 17 % at 1,200: docs/history/benchmarks-notebook.md,
        *the LM head and attention inside the compiled decode*)."""
        assert isinstance(prepared, DecodeInputs)
        return _ATTENTION_REGION(
            queries,
            pool_blocks(keys, self.block_size),
            pool_blocks(values, self.block_size),
            prepared.block_ids,
            prepared.positions,
        )


class _DecodeGraph:
    """One compiled graph of the model's decode step, for steps of ``min_requests``
    to ``max_requests`` requests (one size: static; a range: the number of requests
    is one of the graph's dynamic sizes, the blocks per request the other)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        min_requests: int,
        max_requests: int,
        max_blocks: int,
        head_in_graph: bool,
        max_logit_error: float = MAX_LOGIT_ERROR,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.min_requests = min_requests
        self.max_requests = max_requests
        self.head_in_graph = head_in_graph
        self.max_logit_error = max_logit_error
        self.backend = GraphDecodeAttention(kv_cache.block_size)
        requests = {0: (min_requests, max_requests)} if max_requests > min_requests else {}
        blocks = (MIN_BLOCKS, max_blocks)
        # Inputs: token ids, positions, slots, block ids, decode positions, logits rows.
        dynamic = {index: requests for index in range(6)} | {3: requests | {1: blocks}}
        self._compiled = UnguardedGraph(_DecodeGraph._forward, bound_to=self, dynamic=dynamic)
        self.compile_s = 0.0

    @property
    def name(self) -> str:
        """``graph[1]``, ``graph[2-8]``: the sizes of steps it takes (``step_path.py``)."""
        if self.min_requests == self.max_requests:
            return f"graph[{self.min_requests}]"
        return f"graph[{self.min_requests}-{self.max_requests}]"

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        layout: list[SequenceLayout],
    ) -> torch.Tensor:
        """Logits [requests, vocab] (fp32); the step's K/V are written."""
        inputs = self.backend.prepare(layout, self.kv_cache.block_size, self.model.device)
        with torch.no_grad():
            out = self._compiled(
                torch.tensor(token_ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                torch.tensor(slots, dtype=torch.int64),
                inputs.block_ids,
                inputs.positions,
                torch.arange(len(layout)),
            )
        return out if self.head_in_graph else self.model.logits(out)

    def _forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_ids: torch.Tensor,
        decode_positions: torch.Tensor,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The logits, or the final hidden states where the head is not ``head_in_graph``."""
        inputs = DecodeInputs(block_ids, decode_positions)
        last = _UNDECORATED_FINAL_HIDDEN(
            self.model, token_ids, positions, slot_mapping, self.kv_cache, self.backend, inputs,
            logits_rows,
        )  # fmt: skip
        return _UNDECORATED_LOGITS(self.model, last) if self.head_in_graph else last

    def warm_up(self, num_requests: int, first_block: int) -> float:
        """Compile on a step of ``num_requests`` requests at position 1 of blocks
        ``first_block`` + 2i and + 2i + 1, then check it against the eager forward of
        the same step."""
        from gpu_worker.attention_cpu import CpuAttention

        block_size = self.kv_cache.block_size
        tables = [
            [first_block + 2 * index, first_block + 2 * index + 1] for index in range(num_requests)
        ]
        layout = [SequenceLayout(index, 1, 1, table) for index, table in enumerate(tables)]
        slots = [table[0] * block_size + 1 for table in tables]
        ones = [1] * num_requests
        started = time.perf_counter()
        try:
            compiled = self.run(ones, ones, slots, layout)
        except Exception as error:  # inductor's failures have no common type
            raise DecodeCompileError(f"{type(error).__name__}: {error}") from error
        self.compile_s = time.perf_counter() - started
        backend = CpuAttention(self.model.dtype)
        eager = self.model.forward(
            token_ids=torch.tensor(ones),
            positions=torch.tensor(ones),
            slot_mapping=torch.tensor(slots),
            kv_cache=self.kv_cache,
            backend=backend,
            attention_plan=backend.prepare(layout, block_size, self.model.device),
            logits_rows=torch.arange(num_requests),
        )
        logit_error = max_relative_error(compiled, eager)
        if not logit_error <= self.max_logit_error:  # NaN too
            raise DecodeCompileError(
                f"compiled logits stray {logit_error:.2g} from the eager forward's"
            )
        _log.info(
            "decode_compiled", requests=(self.min_requests, self.max_requests),
            compile_s=round(self.compile_s, 1), logit_error=logit_error,
        )  # fmt: skip
        return self.compile_s


class CompiledDecode:
    """Decode-only steps through compiled graphs of the model: one for a lone
    request (a chat), and for batches where the layers allow it one per range of
    sizes in which every matrix takes one kernel (``batch_ranges``)."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, first_block: int = 0) -> None:
        """Compiles and checks the graphs on warm-up steps written to the pool's blocks
        from ``first_block`` on (``warm_up_blocks`` of them, which no request may hold
        meanwhile); DecodeCompileError if the lone one fails (batch graphs that cannot
        be made are left out, each with a ``batch_decode_not_compiled`` line: those
        batches run eagerly)."""
        if model.device.type != "cpu":
            raise DecodeCompileError(f"compiled decode is for the CPU, not {model.device}")
        untraceable = untraceable_matrices(model)
        if untraceable:
            raise DecodeCompileError(
                f"its {untraceable} layer matrices are only fbgemm's packed objects, "
                "which would break the graph at every matmul"
            )
        if kv_cache.num_blocks - first_block < MIN_BLOCKS:
            raise DecodeCompileError(f"the K/V pool has fewer than {MIN_BLOCKS} blocks for it")
        self.model = model
        self.kv_cache = kv_cache
        self.first_block = first_block
        self.max_blocks = max(
            MIN_BLOCKS + 1, blocks_for(model.config.max_position_embeddings, kv_cache.block_size)
        )
        # The worker is silent while this runs: say why, and where the result is kept.
        _log.info(
            "compiling_decode",
            note="tens of seconds a graph the first time, a few once cached",
            cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default"),
        )
        lone = _DecodeGraph(
            model, kv_cache, 1, 1, self.max_blocks, traceable(model.weights.lm_head)
        )
        self.compile_s = lone.warm_up(1, first_block)
        self._lone_head_in_graph = lone.head_in_graph
        self.graphs = [lone, *self._batch_graphs()]

    @property
    def head_in_graph(self) -> bool:
        """Whether the lone graph ends with the LM head (else it runs after the graph)."""
        return self._lone_head_in_graph

    def graph_for(self, layout: list[SequenceLayout]) -> str | None:
        """The graph that takes a step of decodes only (one new token each), as many
        as it was compiled for, none with a table past the model's context."""
        graph = self._graph_for(len(layout))
        if graph is None or not decodes_within(layout, self.max_blocks):
            return None
        return graph.name

    @property
    def has_lone_graph(self) -> bool:
        """Whether a lone request's decodes still take a graph (none dropped it)."""
        return self._graph_for(1) is not None

    def graph_names(self) -> list[str]:
        """The graphs in use, lone first."""
        return [graph.name for graph in self.graphs]

    def drop(self, name: str) -> None:
        """Run the steps of graph ``name`` eagerly from now on."""
        self.graphs = [graph for graph in self.graphs if graph.name != name]

    def size_ranges(self) -> list[tuple[int, int]]:
        """Each graph's (smallest, largest) number of requests."""
        return [(graph.min_requests, graph.max_requests) for graph in self.graphs]

    def logit_tolerance(self, name: str) -> float | None:
        """The bound its warm-up held the graph to."""
        return next(graph.max_logit_error for graph in self.graphs if graph.name == name)

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        layout: list[SequenceLayout],
    ) -> torch.Tensor:
        """Logits [requests, vocab] (fp32) of a step a graph takes; its K/V are written."""
        graph = self._graph_for(len(layout))
        assert graph is not None, "run a step a graph takes"
        return graph.run(token_ids, positions, slots, layout)

    def _graph_for(self, num_requests: int) -> _DecodeGraph | None:
        for graph in self.graphs:
            if graph.min_requests <= num_requests <= graph.max_requests:
                return graph
        return None

    def _batch_graphs(self) -> list[_DecodeGraph]:
        """A graph per range of ``batch_ranges``, each checked on a warm-up batch (its
        smallest size); those that cannot be made are left out, with a
        ``batch_decode_not_compiled`` line saying why."""
        matrices = layer_matrices(self.model)
        if not batches_traceable(self.model):
            _log.warning(
                "batch_decode_not_compiled",
                reason=f"its layer matrices ({weight_format_of(self.model.weights)}) are not "
                "traced for batches: float16's traced form would read every weight once per "
                "request; the Q4_1 kernel's op does the same arithmetic eagerly, where each "
                "batch graph would cost a first start a minute or more",
                using="the eager forward",
            )
            return []
        graphs = []
        for min_requests, max_requests in batch_ranges(matrices):
            # Checked against the eager forward at the same size, whose matrices
            # take the same kernels (int4's bf16 copy rounds in bf16: a looser bound).
            in_bf16 = any(matrix.computes_dense_bf16(min_requests) for matrix in _packed(matrices))
            max_error = BF16_LOGIT_ERROR if in_bf16 else MAX_LOGIT_ERROR
            graph = _DecodeGraph(
                self.model, self.kv_cache, min_requests, max_requests, self.max_blocks, False,
                max_error,
            )  # fmt: skip
            if self.kv_cache.num_blocks - self.first_block < MIN_BLOCKS * min_requests:
                reason = f"the K/V pool has fewer than {MIN_BLOCKS * min_requests} blocks for it"
            else:
                try:
                    graph.warm_up(min_requests, self.first_block)
                    graphs.append(graph)
                    continue
                except DecodeCompileError as error:
                    reason = str(error)
            _log.warning(
                "batch_decode_not_compiled", requests=(min_requests, max_requests),
                reason=reason, using="the eager forward",
            )  # fmt: skip
        return graphs


def batches_traceable(model: LlamaModel) -> bool:
    """Whether batch graphs can be made of the model's layers."""
    return all(traceable_for_batches(matrix) for matrix in layer_matrices(model))


def planned_size_ranges(model: LlamaModel) -> list[tuple[int, int]]:
    """The ranges of requests of the graphs ``CompiledDecode`` tries to make: the
    lone graph's, then the batch graphs' where the layers allow them."""
    batches = batch_ranges(layer_matrices(model)) if batches_traceable(model) else []
    return [(1, 1), *batches]


def warm_up_blocks(model: LlamaModel) -> int:
    """The blocks the graphs' warm-up steps write (two per request of the largest)."""
    return MIN_BLOCKS * max(low for low, _high in planned_size_ranges(model))


def batch_ranges(matrices: list[torch.Tensor | PackedLinear]) -> list[tuple[int, int]]:
    """The ranges of batch sizes a graph each, split where a matrix changes kernel
    (``kernel_changes_above``: int4's take their 4-bit kernel up to INT4_MAX_ROWS
    rows and their bf16 copy above, a graph one of the two); every other traceable
    matrix takes one kernel for any size."""
    # A range ends at each bound within the batch sizes, the next starts above it.
    bounds = sorted(
        {
            bound
            for matrix in _packed(matrices)
            if (bound := matrix.kernel_changes_above) is not None
            and 2 <= bound < BATCH_MAX_REQUESTS
        }
    )
    firsts = [2, *(bound + 1 for bound in bounds)]
    return list(zip(firsts, [*bounds, BATCH_MAX_REQUESTS], strict=True))


def _packed(matrices: list[torch.Tensor | PackedLinear]) -> list[PackedLinear]:
    """The packed ones of ``matrices``: plain tensors take ``F.linear``, one kernel
    for any size, in the model's own dtype (the graph's bound is the exact one)."""
    return [matrix for matrix in matrices if not isinstance(matrix, torch.Tensor)]


def layer_matrices(model: LlamaModel) -> list[torch.Tensor | PackedLinear]:
    """Every projection of every layer (not the embedding, not the LM head)."""
    return [
        matrix
        for layer in model.weights.layers
        for matrix in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ]


def untraceable_matrices(model: LlamaModel) -> int:
    """How many layer matrices are only fbgemm's packed objects, which torch.compile
    cannot trace (float16's keep a plain copy it can; the LM head, called once after
    the layers, may be either: ``head_in_graph``)."""
    return sum(not traceable(matrix) for matrix in layer_matrices(model))


def compiled_decode_or_none(
    model: LlamaModel, kv_cache: PagedKVCache, first_block: int = 0
) -> CompiledDecode | None:
    """The compiled runner (warmed up on the blocks from ``first_block`` on), or None
    with a ``decode_not_compiled`` line saying why."""
    try:
        return CompiledDecode(model, kv_cache, first_block)
    except DecodeCompileError as error:
        _log.warning("decode_not_compiled", reason=str(error), using="the eager forward")
        return None
