"""Which way one engine step runs: the one place that decides, and the path's name.

A step runs one of three ways: a compiled graph of the whole decode step
(CPU: ``compiled_decode.py``, one graph for a lone request and one per range
of batch sizes; CUDA: captured graphs, ``cuda_graphs.py``), or the eager
forward, whose decodes attend either through the compiled paged attention
(``decode_attention.py``, CPU) or through SDPA over copied blocks. The
choice depends on what was built at start (which graphs, which attention)
and the step's shape (all decodes? how many requests, how many blocks).
Each path is proven against the eager one at start (``path_probe.py``);
its name labels the step's metrics and the dashboard's iteration records.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_worker.attention import SequenceLayout, make_backend
from gpu_worker.decode_attention import MIN_BLOCKS, CompiledDecodeAttention
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.llama import LlamaModel

# Below this many blocks in all (requests x blocks each), SDPA over copied blocks
# is as fast as the compiled paged attention: a compiled call costs about 60 us
# of Python wrappers, a layer's SDPA at 2 requests of 16 tokens about 70 us in
# all (the crossover lay between 8 and 16 blocks: docs/history/benchmarks-notebook.md,
# *batched decodes read the K/V pool in place*).
PAGED_ATTENTION_MIN_BLOCKS = 16

# The eager forward's two ways for its decodes (and its name with neither).
EAGER = "eager"
EAGER_PAGED_ATTENTION = "eager+paged_attention"


class DecodeRunner(Protocol):
    """Compiled graphs of whole decode-only steps: CUDA graphs (``cuda_graphs.py``)
    or the CPU's compiled graphs (``compiled_decode.py``)."""

    def graph_for(self, layout: list[SequenceLayout]) -> str | None:
        """The name of the graph that takes this step (one new token per request,
        each sampled), or None where none does."""
        ...

    def graph_names(self) -> list[str]:
        """Every graph built, by name."""
        ...

    def drop(self, name: str) -> None:
        """Stop using the graph of this name (a probe found it wrong)."""
        ...

    def size_ranges(self) -> list[tuple[int, int]]:
        """The (smallest, largest) number of requests of each graph in use."""
        ...

    def logit_tolerance(self, name: str) -> float | None:
        """How far the graph's logits may stray from the eager forward's, relative to
        the largest (None: the probe's default)."""
        ...

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        layout: list[SequenceLayout],
    ) -> torch.Tensor:
        """Logits [requests, vocab] (fp32) of a step that a graph takes; its K/V are written."""
        ...


@dataclass(frozen=True)
class StepPath:
    """How one step runs: ``graph`` (its name) for a compiled graph of the whole step,
    else the eager forward, its decodes through the paged attention or not."""

    graph: str | None = None
    paged_attention: bool = False

    @property
    def name(self) -> str:
        """What logs, metrics (``path=``) and the dashboard call it."""
        if self.graph is not None:
            return self.graph
        return EAGER_PAGED_ATTENTION if self.paged_attention else EAGER


def takes_paged_attention(
    kernel: CompiledDecodeAttention | None, decodes: list[SequenceLayout]
) -> bool:
    """Whether these decodes (the step's requests with one new token) attend through
    the compiled paged attention: built, sizes it was compiled for, and enough
    blocks in all to be faster than SDPA."""
    if kernel is None or not decodes:
        return False
    num_blocks = max(MIN_BLOCKS, *(len(sequence.block_table) for sequence in decodes))
    return (
        kernel.takes(len(decodes), num_blocks)
        and len(decodes) * num_blocks >= PAGED_ATTENTION_MIN_BLOCKS
    )


def choose(
    layout: list[SequenceLayout],
    all_sampled: bool,
    runner: DecodeRunner | None,
    kernel: CompiledDecodeAttention | None,
) -> StepPath:
    """The path of a step of ``layout``; ``all_sampled``: every request samples a
    token in it (a graph computes logits for every row)."""
    if runner is not None and all_sampled:
        graph = runner.graph_for(layout)
        if graph is not None:
            return StepPath(graph=graph)
    decodes = [sequence for sequence in layout if sequence.num_query_tokens == 1]
    return StepPath(paged_attention=takes_paged_attention(kernel, decodes))


def planned_paths(runner: DecodeRunner | None, kernel: CompiledDecodeAttention | None) -> list[str]:
    """Every path a step may take with these parts, by name (the start's log line)."""
    graphs = runner.graph_names() if runner is not None else []
    eager = [EAGER, EAGER_PAGED_ATTENTION] if kernel is not None else [EAGER]
    return [*graphs, *eager]


@dataclass(frozen=True)
class StepPiece:
    """One request's share of a step: new tokens from ``start_position`` on."""

    request_id: str
    token_ids: list[int]
    start_position: int
    samples: bool  # whether its last token's logits are sampled


@dataclass(frozen=True)
class StepInputs:
    """One step flattened: every request's new tokens in a row, as the forward takes them."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    layout: list[SequenceLayout]
    logits_rows: list[int]  # rows whose next token is sampled

    @classmethod
    def flatten(cls, kv_cache: PagedKVCache, pieces: Iterable[StepPiece]) -> StepInputs:
        """Each request's new tokens one after the other, at their positions and slots
        (its block table in ``kv_cache`` covers them)."""
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        layout: list[SequenceLayout] = []
        logits_rows: list[int] = []
        for piece in pieces:
            end = piece.start_position + len(piece.token_ids)
            table = kv_cache.tables.table(piece.request_id)
            layout.append(
                SequenceLayout(len(token_ids), len(piece.token_ids), piece.start_position, table)
            )
            token_ids.extend(piece.token_ids)
            positions.extend(range(piece.start_position, end))
            slots.extend(kv_cache.slot_ids(piece.request_id, piece.start_position, end))
            if piece.samples:
                logits_rows.append(len(token_ids) - 1)
        return cls(token_ids, positions, slots, layout, logits_rows)

    @property
    def all_sampled(self) -> bool:
        """Every row samples (a decode-only step, or one-token final chunks)."""
        return len(self.logits_rows) == len(self.token_ids)


class StepRunner:
    """Runs a step on the path ``choose`` gives it, from the parts built at start: the
    model and its K/V pool, the attention backend (with the compiled paged attention
    where there is one) and the decode runner's graphs; ``drop`` stops using a part."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        backend_name: str,
        paged_attention: CompiledDecodeAttention | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        # The eager forward's backend with SDPA for every group, and, where the paged
        # attention was compiled, the same backend taking the decodes through it.
        self.backend = make_backend(backend_name, model.dtype)
        self.paged_backend = (
            make_backend(backend_name, model.dtype, paged_attention)
            if paged_attention is not None
            else None
        )
        self.decode_runner: DecodeRunner | None = None

    @property
    def paged_attention(self) -> CompiledDecodeAttention | None:
        """The compiled paged attention, while in use."""
        if self.paged_backend is None:
            return None
        kernel = getattr(self.paged_backend, "decode_kernel", None)
        assert isinstance(kernel, CompiledDecodeAttention)
        return kernel

    def choose(self, inputs: StepInputs) -> StepPath:
        """This step's path (``choose``)."""
        return choose(inputs.layout, inputs.all_sampled, self.decode_runner, self.paged_attention)

    def planned(self) -> list[str]:
        """Every path a step may take now, by name."""
        return planned_paths(self.decode_runner, self.paged_attention)

    def adopt_compiled(self, other: StepRunner) -> None:
        """Take ``other``'s compiled parts (its paged attention and decode graphs, built
        and checked on another thread over the same model and pool) from now on."""
        self.paged_backend = other.paged_backend
        self.decode_runner = other.decode_runner

    def drop(self, name: str) -> None:
        """Stop using the path of this name (a graph, or the paged attention); the
        steps it took run eagerly from now on."""
        if name == EAGER_PAGED_ATTENTION:
            self.paged_backend = None
        elif self.decode_runner is not None and name in self.decode_runner.graph_names():
            self.decode_runner.drop(name)
        else:
            raise ValueError(f"{name!r} is not a path that can be dropped")

    def logit_tolerance(self, name: str) -> float | None:
        """How far the path's logits may stray from the eager forward's (None: the
        caller's default)."""
        runner = self.decode_runner
        if runner is None or name not in runner.graph_names():
            return None
        return runner.logit_tolerance(name)

    def forward(self, inputs: StepInputs, path: StepPath) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] (fp32) of the step on ``path``; its K/V
        are written."""
        if path.graph is not None:
            assert self.decode_runner is not None
            return self.decode_runner.run(
                inputs.token_ids, inputs.positions, inputs.slots, inputs.layout
            )
        backend = self.backend
        if path.paged_attention:
            assert self.paged_backend is not None
            backend = self.paged_backend
        device = self.model.device
        return self.model.forward(
            token_ids=torch.tensor(inputs.token_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(inputs.positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(inputs.slots, dtype=torch.int64, device=device),
            kv_cache=self.kv_cache,
            backend=backend,
            attention_plan=backend.prepare(inputs.layout, self.kv_cache.block_size, device),
            logits_rows=torch.tensor(inputs.logits_rows, dtype=torch.int64, device=device),
        )
