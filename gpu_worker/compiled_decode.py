"""A lone request's decode step on the CPU as one compiled graph (torch.compile, inductor).

On the CPU, a batch-1 decode of a small model is mostly the host's work
between ops: SmolLM2's step is about 1,300 torch calls from Python, a few
microseconds each, around 6 ms of matmuls. Inductor traces the model's own
forward (``final_hidden`` and ``logits``; only ``final_hidden`` where the LM
head is an fbgemm object alone, which then runs after the graph) once for
one token, fuses the norms, RoPE, SwiGLU and residual adds into a few C++
loops per layer and calls the matmul and attention kernels from one
generated function (an LM head on a Q8_0 grid, as the packaged model's, is
one such loop over its int8 form: ``Int8GroupLinear``): the CPU's counterpart of the
CUDA graphs in ``cuda_graphs.py``, for the case a chat is, one request
decoding alone.

One graph serves every context length: its inputs are the token, its
position and slot, and the request's block ids, whose count is the graph's
one dynamic size (``LoneDecodeAttention`` gathers those blocks and masks the
slots past the position, so nothing else depends on the context). Because
the runner only ever calls it so (``fits``), the graph runs without dynamo's
guards, whose checks over hundreds of weight tensors cost most of a
millisecond a call.

Compiling takes tens of seconds on two cores the first time (inductor keeps
its results in ``TORCHINDUCTOR_CACHE_DIR``; a restart takes a few). It is
done once, when the runner is built, and checked against the eager forward
on the same input; where it cannot be done (no C++ compiler, an op inductor
cannot trace) or its logits stray, ``DecodeCompileError`` says why and the
engine keeps the eager forward.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Protocol

import structlog
import torch

from gpu_worker.attention import SequenceLayout
from gpu_worker.decode_attention import MIN_BLOCKS, paged_decode_attention, pool_blocks
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.llama import LlamaModel
from gpu_worker.quantized_linear import traceable
from gpu_worker.unguarded_compile import compile_unguarded, max_relative_error

# How far the compiled step's logits may stray from the eager forward's on the
# warm-up step, relative to the largest logit (fused loops round differently).
MAX_LOGIT_ERROR = 1e-3

_log = structlog.get_logger(__name__)

# What the graph is: the forward, or the forward up to the LM head where the head
# is only fbgemm's packed object, which the tracer cannot enter (it then runs
# after the graph); without their inference_mode decorators: the graph is traced
# and run under no_grad (inductor fails on some graphs that mutate the K/V pool
# in inference mode: "Cannot set version_counter for inference tensor").
_UNDECORATED_FINAL_HIDDEN = LlamaModel.final_hidden.__wrapped__  # type: ignore[attr-defined]
_UNDECORATED_LOGITS = LlamaModel.logits.__wrapped__  # type: ignore[attr-defined]


class DecodeRunner(Protocol):
    """Runs some decode-only steps faster than the eager forward: CUDA graphs
    (``cuda_graphs.py``) or the compiled graph here."""

    def fits(self, layout: list[SequenceLayout]) -> bool:
        """Whether ``run`` can take this step (one new token per request)."""
        ...

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        layout: list[SequenceLayout],
    ) -> torch.Tensor:
        """Logits [requests, vocab] (fp32) of the step; its K/V are written."""
        ...


class DecodeCompileError(RuntimeError):
    """The decode step cannot be compiled here, or its result strays; the eager forward runs."""


@dataclass(frozen=True)
class LoneDecodePlan:
    """What attention needs of the step: tensors only, so nothing is baked into the graph."""

    block_ids: torch.Tensor  # [max(blocks, MIN_BLOCKS)] int64
    position: torch.Tensor  # [1] int64: the new token's; slots past it are masked


class LoneDecodeAttention:
    """One request's one new query over its blocks, gathered by id."""

    name = "lone-decode"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(
        self, layout: list[SequenceLayout], block_size: int, device: torch.device
    ) -> LoneDecodePlan:
        (sequence,) = layout
        table = sequence.block_table
        padded = table + [table[-1]] * (MIN_BLOCKS - len(table))
        return LoneDecodePlan(
            block_ids=torch.tensor(padded, dtype=torch.int64, device=device),
            position=torch.tensor([sequence.num_cached_tokens], dtype=torch.int64, device=device),
        )

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
        """``queries`` [1, heads, head_dim] -> [1, heads, head_dim]: the paged decode
        attention, which inductor fuses with the gather of the blocks into a few loops
        reading the request's keys and values where they lie (SDPA's kernel cost tens
        of microseconds a layer at one query, on blocks copied for it: a token 10 %
        faster at 128 tokens of context, 17 % at 1,200: docs/benchmarks.md,
        *Issue 14, seventh step*)."""
        assert isinstance(prepared, LoneDecodePlan)
        return paged_decode_attention(
            queries,
            pool_blocks(keys, self.block_size),
            pool_blocks(values, self.block_size),
            prepared.block_ids[None],
            prepared.position,
        )


class CompiledDecode:
    """Decode steps of one request alone, through one inductor graph of the model."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache) -> None:
        """Compiles and checks the graph on a warm-up step written to the pool's
        first blocks (free while the engine starts); DecodeCompileError if it fails."""
        if model.device.type != "cpu":
            raise DecodeCompileError(f"compiled decode is for the CPU, not {model.device}")
        untraceable = untraceable_matrices(model)
        if untraceable:
            raise DecodeCompileError(
                f"its {untraceable} layer matrices are only fbgemm's packed objects (int8), "
                "which would break the graph at every matmul"
            )
        if kv_cache.num_blocks < MIN_BLOCKS:
            raise DecodeCompileError(f"the K/V pool has fewer than {MIN_BLOCKS} blocks")
        self.model = model
        self.kv_cache = kv_cache
        self.backend = LoneDecodeAttention(kv_cache.block_size)
        self.head_in_graph = traceable(model.weights.lm_head)
        self._logits_rows = torch.zeros(1, dtype=torch.int64)
        block_size = kv_cache.block_size
        self._max_blocks = max(
            MIN_BLOCKS + 1, -(-model.config.max_position_embeddings // block_size)
        )
        self._compiled = compile_unguarded(CompiledDecode._forward, bound_to=self)
        # The worker is silent while this runs: say why, and where the result is kept.
        _log.info(
            "compiling_decode",
            note="tens of seconds the first time, a few once cached",
            cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default"),
        )
        self.compile_s = self._warm_up()

    def fits(self, layout: list[SequenceLayout]) -> bool:
        """One request, one new token: the only step the graph was traced for."""
        return (
            len(layout) == 1
            and layout[0].num_query_tokens == 1
            and len(layout[0].block_table) <= self._max_blocks
        )

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        layout: list[SequenceLayout],
    ) -> torch.Tensor:
        """Logits [1, vocab] (fp32) of a step that ``fits``; its K/V are written."""
        plan = self.backend.prepare(layout, self.kv_cache.block_size, self.model.device)
        torch._dynamo.mark_dynamic(plan.block_ids, 0, min=MIN_BLOCKS, max=self._max_blocks)
        with torch.no_grad():
            out = self._compiled(
                torch.tensor(token_ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                torch.tensor(slots, dtype=torch.int64),
                plan,
            )
        return out if self.head_in_graph else self.model.logits(out)

    def _forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: LoneDecodePlan,
    ) -> torch.Tensor:
        """The logits, or the final hidden state where the head is not ``head_in_graph``."""
        last = _UNDECORATED_FINAL_HIDDEN(
            self.model, token_ids, positions, slot_mapping, self.kv_cache, self.backend, plan,
            self._logits_rows,
        )  # fmt: skip
        return _UNDECORATED_LOGITS(self.model, last) if self.head_in_graph else last

    def _warm_up(self) -> float:
        """Compile on a step at position 1 of blocks 0 and 1, then check it
        against the eager forward of the same step."""
        from gpu_worker.attention_cpu import CpuAttention

        block_size = self.kv_cache.block_size
        layout = [SequenceLayout(0, 1, 1, list(range(MIN_BLOCKS)))]
        inputs = ([1], [1], [1], layout)
        started = time.perf_counter()
        try:
            compiled = self.run(*inputs)
        except Exception as error:  # inductor's failures have no common type
            raise DecodeCompileError(f"{type(error).__name__}: {error}") from error
        compile_s = time.perf_counter() - started
        backend = CpuAttention(self.model.dtype)
        eager = self.model.forward(
            token_ids=torch.tensor([1]),
            positions=torch.tensor([1]),
            slot_mapping=torch.tensor([1]),
            kv_cache=self.kv_cache,
            backend=backend,
            attention_plan=backend.prepare(layout, block_size, self.model.device),
            logits_rows=self._logits_rows,
        )
        logit_error = max_relative_error(compiled, eager)
        if not logit_error <= MAX_LOGIT_ERROR:  # NaN too
            raise DecodeCompileError(
                f"compiled logits stray {logit_error:.2g} from the eager forward's"
            )
        _log.info("decode_compiled", compile_s=round(compile_s, 1), logit_error=logit_error)
        return compile_s


def untraceable_matrices(model: LlamaModel) -> int:
    """How many layer matrices are only fbgemm's packed objects, which torch.compile
    cannot trace (float16's keep a plain copy it can; the LM head, called once after
    the layers, may be either: ``head_in_graph``)."""
    return sum(
        not traceable(matrix)
        for layer in model.weights.layers
        for matrix in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    )


def compiled_decode_or_none(model: LlamaModel, kv_cache: PagedKVCache) -> CompiledDecode | None:
    """The compiled runner, or None with a ``decode_not_compiled`` line saying why."""
    try:
        return CompiledDecode(model, kv_cache)
    except DecodeCompileError as error:
        _log.warning("decode_not_compiled", reason=str(error), using="the eager forward")
        return None
