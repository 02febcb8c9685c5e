"""Before a worker serves: every step path it will use, checked against the eager one.

Each compiled part was checked alone when it was compiled (one warm-up step
each). What that does not cover is how they meet in a real run: requests
joining and leaving a batch (the lone graph, a batch graph, back), mixed
steps whose decodes take the paged attention beside a prompt chunk, block
counts on both sides of the paged attention's threshold, every range of
batch sizes a graph takes. ``probe_step_paths`` runs such a sequence on
blocks of the engine's pool that no served request is granted (held back
at start: ``path_compiler.py``), random prompt tokens and
greedy tokens fed back, each step twice: on the path ``choose`` gives it,
then on the eager forward with SDPA (which rewrites the step's K/V, so both
go on from the same cache). A path whose logits stray from the eager ones
is dropped, with a ``step_path_dropped`` line naming it: its steps run
eagerly. A wrong path never serves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import structlog
import torch

from gpu_worker.block_tables import blocks_for
from gpu_worker.decode_attention import MIN_BLOCKS
from gpu_worker.quantized_linear import BF16_LOGIT_ERROR, rounds_in_bf16
from gpu_worker.step_path import (
    EAGER,
    PAGED_ATTENTION_MIN_BLOCKS,
    StepInputs,
    StepPath,
    StepPiece,
    StepRunner,
)
from gpu_worker.unguarded_compile import max_relative_error

# How far a path's logits may stray from the eager forward's, relative to the
# largest logit, unless its runner allows more (bf16 graphs). Fused loops and
# another LM head round differently: SmolLM2's lone float16 graph strays up to
# 6.5e-4 over the probe (its head in int8 against fbgemm's fp16), the paged
# attention 1.4e-6. A path that reads the wrong data strays by far more: 0.95
# when the paged attention took its queries as a strided view. Layers that
# round to bf16 (int4) allow ``BF16_LOGIT_ERROR`` on every path.
MAX_LOGIT_ERROR = 5e-3
# Decode steps each request takes in a row before the batch changes.
DECODES_PER_SHAPE = 2

_log = structlog.get_logger(__name__)


@dataclass
class _ProbeRequest:
    request_id: str
    prompt_ids: list[int]
    num_cached_tokens: int = 0
    last_token_id: int = 0
    blocks: list[int] = field(default_factory=list)


class _Probe:
    """The probe's requests on the engine's pool, and each path's largest error."""

    def __init__(
        self, runner: StepRunner, num_requests: int, long_prompt: int, first_block: int
    ) -> None:
        self.runner = runner
        cache = runner.kv_cache
        vocab = runner.model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        # The first request long enough that two decodes beside it reach the paged
        # attention's threshold; the others a few tokens (one block each).
        lengths = [long_prompt] + [3] * (num_requests - 1)
        self.requests = [
            _ProbeRequest(
                f"path-probe-{index}", torch.randint(vocab, (length,), generator=generator).tolist()
            )
            for index, length in enumerate(lengths)
        ]
        self.errors: dict[str, float] = {}
        # The long request's blocks consecutive (as a lone chat's), the others' from
        # the pool's far end, so tables are in no order; all from ``first_block`` on.
        self._next_block = first_block
        self._last_block = cache.num_blocks - 1

    def grow(self, request: _ProbeRequest, num_tokens: int) -> None:
        cache = self.runner.kv_cache
        needed = blocks_for(num_tokens, cache.block_size) - len(request.blocks)
        new: list[int] = []
        for _ in range(needed):
            if request is self.requests[0]:
                new.append(self._next_block)
                self._next_block += 1
            else:
                new.append(self._last_block)
                self._last_block -= 1
        assert self._next_block <= self._last_block + 1, "the probe outgrew the pool"
        request.blocks.extend(new)
        cache.tables.extend(request.request_id, new)

    def step(self, prefills: list[_ProbeRequest], decodes: list[_ProbeRequest]) -> None:
        """Prompts of ``prefills`` whole, one token of each of ``decodes``: on the
        chosen path, then eagerly; the eager tokens are fed back."""
        work = [(request, request.prompt_ids) for request in prefills]
        work += [(request, [request.last_token_id]) for request in decodes]
        for request, new_ids in work:
            self.grow(request, request.num_cached_tokens + len(new_ids))
        pieces = [
            StepPiece(request.request_id, new_ids, request.num_cached_tokens, True)
            for request, new_ids in work
        ]
        inputs = StepInputs.flatten(self.runner.kv_cache, pieces)
        path = self.runner.choose(inputs)
        eager = StepPath()
        if path != eager:
            logits = self.runner.forward(inputs, path)
        # The eager step writes the step's K/V last: both paths go on from its cache.
        reference = self.runner.forward(inputs, eager)
        if path != eager:
            error = max_relative_error(logits, reference)
            previous = self.errors.get(path.name, 0.0)
            # The worst so far; a NaN, once seen, stays (it fails every bound).
            if math.isnan(error) or not previous >= error:
                self.errors[path.name] = previous if math.isnan(previous) else error
        for (request, new_ids), row in zip(work, reference.argmax(-1).tolist(), strict=True):
            request.num_cached_tokens += len(new_ids)
            request.last_token_id = int(row)

    def forget(self) -> None:
        for request in self.requests:
            self.runner.kv_cache.tables.forget(request.request_id)


class _TokenCount:
    """The probe's sequence counted, not run: how many blocks and tokens it needs."""

    def __init__(self, num_requests: int, long_prompt: int) -> None:
        lengths = [long_prompt] + [3] * (num_requests - 1)
        self.requests = [_ProbeRequest(f"count-{i}", [0] * n) for i, n in enumerate(lengths)]

    def step(self, prefills: list[_ProbeRequest], decodes: list[_ProbeRequest]) -> None:
        for request in prefills:
            request.num_cached_tokens += len(request.prompt_ids)
        for request in decodes:
            request.num_cached_tokens += 1

    def num_blocks(self, block_size: int) -> int:
        return sum(blocks_for(r.num_cached_tokens, block_size) for r in self.requests)

    def longest(self) -> int:
        return max(request.num_cached_tokens for request in self.requests)


def _long_prompt(block_size: int) -> int:
    """The first request's prompt: 2 decodes at its width reach the paged
    attention's threshold."""
    long_blocks = max(MIN_BLOCKS, -(-PAGED_ATTENTION_MIN_BLOCKS // 2)) + 1
    return (long_blocks - 1) * block_size + 1


def probe_needs(block_size: int, size_ranges: list[tuple[int, int]]) -> tuple[int, int]:
    """The blocks and the longest sequence (tokens) the probe takes for decode
    graphs of these ranges of sizes."""
    sizes = batch_sizes(size_ranges)
    counted = _TokenCount(max(3, *sizes), _long_prompt(block_size))
    _run_sequence(counted, sizes)
    return counted.num_blocks(block_size), counted.longest()


def probe_step_paths(runner: StepRunner, first_block: int = 0) -> dict[str, float]:
    """Run the probe on ``runner``'s pool, on its blocks from ``first_block`` on
    (which no request may hold while it runs), and drop every path whose logits
    stray; each path's largest error, by name. Where those blocks cannot hold the
    probe, every compiled path is dropped (nothing unchecked serves)."""
    compiled = [name for name in runner.planned() if name != EAGER]
    if not compiled:
        return {}
    cache = runner.kv_cache
    size_ranges = runner.decode_runner.size_ranges() if runner.decode_runner else []
    sizes = batch_sizes(size_ranges)
    needed, longest = probe_needs(cache.block_size, size_ranges)
    num_free = cache.num_blocks - first_block
    if needed > num_free or longest > runner.model.config.max_position_embeddings:
        for name in compiled:
            runner.drop(name)
        _log.warning(
            "step_path_dropped", paths=compiled, using="the eager forward",
            reason=f"the K/V pool ({num_free} blocks for it) or the context cannot hold "
            f"the start's path probe ({needed} blocks, {longest} tokens)",
        )  # fmt: skip
        return {}
    probe = _Probe(runner, max(3, *sizes), _long_prompt(cache.block_size), first_block)
    try:
        _run_sequence(probe, sizes)
    finally:
        probe.forget()
    least_bound = BF16_LOGIT_ERROR if rounds_in_bf16(runner.model.weights) else MAX_LOGIT_ERROR
    for name, error in probe.errors.items():
        bound = max(runner.logit_tolerance(name) or 0.0, least_bound)
        if not error <= bound:  # NaN too
            runner.drop(name)
            _log.error(
                "step_path_dropped", path=name, logit_error=error, bound=bound,
                using="the eager forward",
            )  # fmt: skip
    _log.info("step_paths_probed", logit_errors=probe.errors)
    return probe.errors


def batch_sizes(size_ranges: list[tuple[int, int]]) -> list[int]:
    """Decode batch sizes the probe runs: both ends of every graph's range of sizes
    it can reach (its smallest and one more), at least 2 and 3."""
    sizes = {2, 3}
    for low, high in size_ranges:
        sizes.update(size for size in (low, low + 1) if size <= high)
    return sorted(size for size in sizes if size >= 2)


def _run_sequence(probe: _Probe | _TokenCount, sizes: list[int]) -> None:
    """Joins, leaves and mixed steps through every path the runner may choose."""
    long, second, third, *rest = probe.requests
    probe.step([long], [])
    for _ in range(DECODES_PER_SHAPE):
        probe.step([], [long])  # a lone decode
    probe.step([second], [long])  # a join: a prompt beside one decode
    for _ in range(DECODES_PER_SHAPE):
        probe.step([], [long, second])  # a batch past the paged threshold
    probe.step([third], [long, second])  # mixed: its decodes through the paged attention
    for _ in range(DECODES_PER_SHAPE):
        probe.step([], [long])  # back to one
    for _ in range(DECODES_PER_SHAPE):
        probe.step([], [second, third])  # a batch below the threshold
    if rest:
        probe.step(rest, [long, second, third])
    running = probe.requests
    for size in sizes:
        for _ in range(DECODES_PER_SHAPE):
            probe.step([], running[:size])
    probe.step([], [long])  # and a lone decode after the largest batch
