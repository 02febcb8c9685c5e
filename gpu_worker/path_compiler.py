"""The CPU's compiled step paths, built and checked while the engine serves eagerly.

Compiling the paged decode attention and the decode graphs takes a few
seconds from inductor's cache and a minute or more without it on two cores,
and the probe that checks them against the eager forward (``path_probe.py``)
a second more. A worker that waited for all of it answered its first request
a minute after an empty cache folder's start. ``StepPathCompiler`` does the
work on a thread of its own while every step runs on the eager forward, in
two stages: the paged attention (seconds), then the decode graphs; each
stage's parts serve from the step after they passed the probe
(``Engine.install_paths``: a ``step_path_live`` line each, then one
``step_paths_settled``). A part that fails to compile or strays never
serves, as before.

Its warm-up steps and the probe write K/V, so the engine holds back the
blocks they need at the pool's far end (``held_back_blocks``, 11 of
SmolLM2's 3,072 with float16 layers): the scheduler is never told of them,
and the compiler reaches them through block tables of its own
(``PagedKVCache.with_own_tables``), so the serving thread's requests and
tables are never touched.

A compile from scratch on this thread would hold the interpreter's lock for
long stretches and slow every step 30-fold meanwhile; the worker runs that
first compile in a process of its own (``compile_cache_warmer.py``), which
this thread waits for, and then compiles from inductor's cache in seconds.

The thread cannot be interrupted (a compile runs in inductor's code): it is
a daemon, and a worker that stops meanwhile ends it with the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from gpu_worker.compiled_decode import compiled_decode_or_none, planned_size_ranges, warm_up_blocks
from gpu_worker.decode_attention import compiled_decode_attention_or_none
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.llama import LlamaModel
from gpu_worker.path_probe import probe_needs, probe_step_paths
from gpu_worker.step_path import StepRunner

_log = structlog.get_logger(__name__)

# What the compiler hands over: its runner, whose compiled parts serve from the next
# step, and whether it is done (no more parts will come).
Install = Callable[[StepRunner, bool], None]
# Runs the first compile for a pool of (num_blocks, block_size) in another process
# (``compile_cache_warmer.py``), so that the thread's own compile only loads.
WarmCompileCache = Callable[[int, int], None]


def held_back_blocks(model: LlamaModel, block_size: int) -> int:
    """Blocks the compiler's warm-up steps and probe need: held back from the
    scheduler at the pool's far end."""
    probe_blocks, _tokens = probe_needs(block_size, planned_size_ranges(model))
    return max(probe_blocks, warm_up_blocks(model))


class StepPathCompiler:
    """Builds the paged attention and the decode graphs for ``model`` over the
    pool's blocks from ``first_block`` on, checks each stage with the probe, and
    hands it to ``install``."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        backend_name: str,
        first_block: int,
        install: Install,
        warm_compile_cache: WarmCompileCache | None = None,
    ) -> None:
        self.model = model
        self.warm_compile_cache = warm_compile_cache
        self.kv_cache = kv_cache.with_own_tables()
        self.backend_name = backend_name
        self.first_block = first_block
        self._install = install
        self._thread: threading.Thread | None = None

    def start_in_background(self) -> None:
        """Build on a thread of its own (``join`` waits for it)."""
        self._thread = threading.Thread(target=self.run, name="step-path-compiler", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the background build; True once it is done."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def run(self) -> None:
        """Both stages, each installed once probed; a failure leaves what passed
        serving and says why (``step_path_compile_failed``)."""
        model, config = self.model, self.model.config
        runner = StepRunner(model, self.kv_cache, self.backend_name)
        checked = StepRunner(model, self.kv_cache, self.backend_name)  # what passed: nothing yet
        try:
            if self.warm_compile_cache is not None:
                # Waits without the interpreter's lock: the steps go on at full speed.
                self.warm_compile_cache(self.kv_cache.num_blocks, self.kv_cache.block_size)
            if self.backend_name == "cpu":
                paged_attention = compiled_decode_attention_or_none(
                    config.num_kv_heads, config.num_heads, config.head_dim,
                    config.max_position_embeddings, self.kv_cache.block_size, model.dtype,
                )  # fmt: skip
                if paged_attention is not None:
                    runner = StepRunner(model, self.kv_cache, self.backend_name, paged_attention)
                    probe_step_paths(runner, self.first_block)
                    checked.adopt_compiled(runner)
                    self._install(checked, False)
            runner.decode_runner = compiled_decode_or_none(model, self.kv_cache, self.first_block)
            probe_step_paths(runner, self.first_block)
            checked.adopt_compiled(runner)
        except Exception:  # inductor's and dynamo's failures have no common type
            _log.exception("step_path_compile_failed", using="the paths checked before")
        self._install(checked, True)
