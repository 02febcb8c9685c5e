"""``Engine.step(plan) -> StepOutput``: one selective-batched iteration.

The engine keeps, per request it runs, how many tokens are in its K/V cache
and what it sampled last; a plan names the work (prompt chunks, decodes) and
the engine flattens it into one forward pass, samples, and reports tokens.
Requests join, continue and leave between any two steps. The plan also grants
the K/V blocks each request writes (the scheduler owns the block tables, so a
prompt may start after a prefix cached in blocks other requests share).

Faults of one request end that request only (``StepOutput.failed``): a prompt
token id the model has no embedding for, a position past the model's
context, logits that cannot be sampled. A forward pass that raises fails the
step's requests, and the engine goes on with the next plan. A plan that does
not fit the engine's state (the scheduler's mistake) is a ``PlanError``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from gpu_worker.attention import AttentionBackend, default_backend_name
from gpu_worker.block_tables import blocks_for
from gpu_worker.compiled_decode import CompiledDecode
from gpu_worker.engine_stats import EngineStats
from gpu_worker.kv_cache import KVCacheBudget, KVCacheSize, PagedKVCache, kv_cache_size
from gpu_worker.llama import LlamaModel
from gpu_worker.path_compiler import StepPathCompiler, WarmCompileCache, held_back_blocks
from gpu_worker.sampler import SamplingRow, sample_rows
from gpu_worker.step_path import StepInputs, StepPiece, StepRunner
from shared.messages import (
    FinishReason,
    RequestFailure,
    RequestSpec,
    SampledToken,
    StepOutput,
    StepPlan,
)

# A decode (or the next prompt chunk) may be planned for a request whose last
# token or failure is still on its way to the scheduler (overlap); remember
# that many ended ids to skip their work.
_RECENTLY_ENDED_LIMIT = 65536
# What a client is told when the step its request was in failed as a whole.
STEP_FAILED_MESSAGE = "the worker failed to run this request's step"

_log = structlog.get_logger(__name__)

# Told the paths in use by name, and whether more are being compiled.
PathsChanged = Callable[[list[str], bool], None]


class PlanError(ValueError):
    """A plan the engine cannot run as given; the engine's state is unchanged."""


@dataclass
class _Request:
    spec: RequestSpec
    seed: int
    stop_token_ids: frozenset[int]
    num_generated: int
    num_cached_tokens: int = 0
    last_token_id: int | None = None

    @property
    def prompt_done(self) -> bool:
        return self.num_cached_tokens >= self.spec.num_prompt_tokens


@dataclass
class _Work:
    """One request's share of a step."""

    request: _Request
    token_ids: list[int]
    start_position: int
    samples: bool


@dataclass
class PreparedStep:
    """A plan's step between ``begin_step`` and ``finish_step``: its work, flattened."""

    epoch: int
    step_index: int
    works: list[_Work]
    failed: list[RequestFailure]  # requests that ended on their own input, before the step
    inputs: StepInputs

    def sampling_rows(self) -> list[SamplingRow]:
        """What the sampler needs of each request that samples in this step, in row order."""
        return [
            SamplingRow(
                work.request.spec.sampling,
                work.request.seed,
                work.request.num_generated,
                sorted(work.request.stop_token_ids),
            )
            for work in self.works
            if work.samples
        ]


@dataclass(frozen=True)
class StepOutcome:
    """What the forward pass and the sampler made of a step: each sampling row's token
    id, or why it could not be sampled; and the name of the step's path."""

    samples: list[int | str]
    path: str
    stage_ms: list[float] = field(default_factory=list)  # a worker group's, stage by stage


class Engine:
    """Runs plans on one model and one paged K/V cache."""

    def __init__(
        self,
        model: LlamaModel,
        kv_budget: KVCacheBudget | KVCacheSize | None = None,
        attention_backend: str | None = None,
        worker_id: str = "local",
        use_cuda_graphs: bool = False,
        compile_decode: bool = False,
        compile_in_background: bool = False,
        on_paths_changed: PathsChanged | None = None,
        warm_compile_cache: WarmCompileCache | None = None,
    ) -> None:
        """``use_cuda_graphs`` replays captured graphs for decode-only steps; it takes
        effect on CUDA only (needs the ``triton`` backend) and is ignored on the CPU.
        ``compile_decode`` runs decode-only steps through compiled graphs on the CPU
        (``compiled_decode.py``), and other steps' decodes through the compiled paged
        attention (``decode_attention.py``) where the backend is ``cpu``; where either
        cannot be compiled, a log line says why. Which path each step takes:
        ``step_path.py``; every compiled path is checked against the eager one on
        joining, leaving and mixed steps before it serves (``path_probe.py``), and
        one that strays is dropped with a log line. ``compile_in_background``: the
        engine serves on the eager forward at once while the compiled paths are
        built (``path_compiler.py``); else they are built before this returns.
        ``on_paths_changed`` hears of each change of the paths in use (from the
        compiler's thread); ``warm_compile_cache(num_blocks, block_size)``, given, runs
        the first compile in a process of its own before the thread's own
        (``compile_cache_warmer.py``)."""
        self.model = model
        self.worker_id = worker_id
        self.stats = EngineStats()
        self._started_s = time.perf_counter()
        if isinstance(kv_budget, KVCacheSize):  # sized by the caller (a worker group)
            size = kv_budget
        else:  # sized once the model is loaded: what it takes is no longer available
            size = kv_cache_size(
                model.config, kv_budget or KVCacheBudget(), model.device, model.dtype
            )
        # A pool asked for below one full-context sequence serves only shorter requests.
        log = _log.info if size.num_full_sequences > 0 else _log.warning
        log("kv_cache_sized", device=str(model.device), **size.log_fields())
        self.kv_cache_size = size
        self.kv_cache = PagedKVCache(
            model.config, size.num_blocks, size.block_size, model.device, model.dtype
        )
        backend_name = attention_backend or default_backend_name(model.device)
        self.paths = StepRunner(model, self.kv_cache, backend_name)
        # Held by a step's forward pass, and by the compiler to swap the paths in.
        self._paths_lock = threading.Lock()
        self._on_paths_changed = on_paths_changed
        self._num_held_back = 0
        self.path_compiler: StepPathCompiler | None = None
        if use_cuda_graphs and model.device.type == "cuda":
            from gpu_worker.cuda_graphs import DecodeGraphRunner

            self.paths.decode_runner = DecodeGraphRunner(model, self.kv_cache, self.backend)
        elif compile_decode and model.device.type == "cpu":
            self.path_compiler = self._path_compiler(backend_name, warm_compile_cache)
        self.stats.live_paths = self.paths.planned()
        self.stats.compiling_paths = self.path_compiler is not None
        _log.info("step_paths", paths=self.stats.live_paths, compiling=self.stats.compiling_paths)
        if on_paths_changed is not None:  # before the compiler's thread may tell of more
            on_paths_changed(self.stats.live_paths, self.stats.compiling_paths)
        self._requests: dict[str, _Request] = {}
        self._recently_ended: OrderedDict[str, None] = OrderedDict()
        # Rows of the embedding table: a prompt token id must index one of them.
        self._num_embeddings = int(model.weights.embed_tokens.shape[0])
        if self.path_compiler is not None:
            if compile_in_background:
                self.path_compiler.start_in_background()
            else:
                self.path_compiler.run()

    def _path_compiler(
        self, backend_name: str, warm_compile_cache: WarmCompileCache | None
    ) -> StepPathCompiler | None:
        """The compiler of the CPU's paths, on blocks held back at the pool's far end;
        None, with a line saying why, where the pool is too small to spare them."""
        held_back = held_back_blocks(self.model, self.kv_cache.block_size)
        if 2 * held_back > self.kv_cache.num_blocks:
            _log.warning(
                "step_paths_not_compiled", using="the eager forward",
                reason=f"the start's checks of compiled paths need {held_back} K/V blocks "
                f"held back, more than half of the pool's {self.kv_cache.num_blocks}",
            )  # fmt: skip
            return None
        self._num_held_back = held_back
        return StepPathCompiler(
            self.model, self.kv_cache, backend_name, self.num_blocks, self.install_paths,
            warm_compile_cache,
        )  # fmt: skip

    def install_paths(self, compiled: StepRunner, settled: bool) -> None:
        """Serve ``compiled``'s checked parts from the next step on (``settled``: the
        last of them); a ``step_path_live`` line for each path new to the steps."""
        with self._paths_lock:
            before = set(self.paths.planned())
            self.paths.adopt_compiled(compiled)
            live = self.paths.planned()
        after_start_s = round(time.perf_counter() - self._started_s, 1)
        for name in live:
            if name not in before:
                _log.info("step_path_live", path=name, after_start_s=after_start_s)
        self.stats.live_paths = live
        self.stats.compiling_paths = not settled
        if settled:
            _log.info("step_paths_settled", paths=live, after_start_s=after_start_s)
        if self._on_paths_changed is not None:
            self._on_paths_changed(live, not settled)

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend of the eager forward (without the paged attention)."""
        return self.paths.backend

    @property
    def compiles_decode(self) -> bool:
        """Whether a lone request's decode steps run through a compiled graph (CPU)."""
        runner = self.paths.decode_runner
        return isinstance(runner, CompiledDecode) and runner.has_lone_graph

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether decode-only steps replay CUDA graphs (the other decode runner)."""
        runner = self.paths.decode_runner
        return runner is not None and not isinstance(runner, CompiledDecode)

    @property
    def num_blocks(self) -> int:
        """K/V blocks the scheduler may grant: the pool's but those held back for the
        start's checks of compiled paths (``path_compiler.py``)."""
        return self.kv_cache.num_blocks - self._num_held_back

    @property
    def block_size(self) -> int:
        """Token slots per K/V block."""
        return self.kv_cache.block_size

    @property
    def num_free_blocks(self) -> int:
        """K/V blocks in no running request's table (the scheduler may still
        keep cached prefixes in them)."""
        return self.num_blocks - self.kv_cache.tables.num_referenced()

    @property
    def active_request_ids(self) -> list[str]:
        """Requests with state (and K/V) on this engine."""
        return list(self._requests)

    def step(self, plan: StepPlan) -> StepOutput:
        """Release, admit, then run every prompt chunk and decode in one forward pass.

        Raises PlanError (state unchanged) for a plan that does not fit the
        engine's state; a request whose own input or numbers fail is dropped
        and reported in ``StepOutput.failed``, the others run.
        """
        prepared = self.begin_step(plan)
        if isinstance(prepared, StepOutput):
            return prepared
        started = time.perf_counter()
        try:
            outcome = self.compute(prepared)
        except Exception:  # any fault of the forward ends its step, not the worker
            num_requests = len(prepared.works)
            _log.exception("step_failed", step_index=plan.step_index, num_requests=num_requests)
            outcome = None
        return self.finish_step(prepared, outcome, (time.perf_counter() - started) * 1000)

    def begin_step(self, plan: StepPlan) -> StepOutput | PreparedStep:
        """A plan's changes of state (releases, admissions, grants, the K/V its tokens
        will fill) and its step flattened; a ``StepOutput`` at once where nothing runs.
        The forward and the sampling come between this and ``finish_step``: here
        (``compute``) or down a pipeline of stages (``pipeline_driver.py``).
        Raises PlanError (state unchanged) as ``step``."""
        admitted, works, growth, failed = self._validate(plan)
        self._check_grants(plan, growth)
        for request_id in plan.released_request_ids:
            self._drop(request_id)
        for request in admitted:
            self._requests[request.spec.request_id] = request
        for failure in failed:
            self._end(failure.request_id)
        tables = self.kv_cache.tables
        for request_id, block_ids in plan.block_grants.items():
            if request_id in self._requests:
                tables.extend(request_id, block_ids)
        if not works:
            return StepOutput(
                worker_id=self.worker_id,
                epoch=plan.epoch,
                step_index=plan.step_index,
                failed=failed,
            )
        pieces = (
            StepPiece(w.request.spec.request_id, w.token_ids, w.start_position, w.samples)
            for w in works
        )
        inputs = StepInputs.flatten(self.kv_cache, pieces)
        for work in works:
            work.request.num_cached_tokens += len(work.token_ids)
        return PreparedStep(plan.epoch, plan.step_index, works, failed, inputs)

    def compute(self, prepared: PreparedStep) -> StepOutcome:
        """The prepared step's forward pass and samples, on this engine's paths."""
        inputs = prepared.inputs
        with self._paths_lock:
            path = self.paths.choose(inputs)
            logits = self.paths.forward(inputs, path)
        return StepOutcome(sample_rows(logits, prepared.sampling_rows()), path.name)

    def finish_step(
        self, prepared: PreparedStep, outcome: StepOutcome | None, step_ms: float
    ) -> StepOutput:
        """Record the step's samples (``outcome`` None: its forward failed, and so do
        its requests, whose K/V may be half written)."""
        works = prepared.works
        if outcome is None:
            request_ids = [work.request.spec.request_id for work in works]
            return StepOutput(
                worker_id=self.worker_id,
                epoch=prepared.epoch,
                step_index=prepared.step_index,
                failed=prepared.failed + self.fail_requests(request_ids, STEP_FAILED_MESSAGE),
            )
        tokens: list[SampledToken] = []
        sampling_failed: list[RequestFailure] = []
        sampling_works = [work for work in works if work.samples]
        for work, sampled in zip(sampling_works, outcome.samples, strict=True):
            if isinstance(sampled, str):
                self._end(work.request.spec.request_id)
                sampling_failed.append(RequestFailure(work.request.spec.request_id, sampled))
            else:
                tokens.append(self._record(work.request, sampled))
        num_new_tokens = sum(len(work.token_ids) for work in works)
        self.stats.num_steps += 1
        self.stats.num_tokens += num_new_tokens
        self.stats.busy_s += step_ms / 1000
        return StepOutput(
            worker_id=self.worker_id,
            epoch=prepared.epoch,
            step_index=prepared.step_index,
            tokens=tokens,
            num_new_tokens=num_new_tokens,
            step_ms=step_ms,
            failed=prepared.failed + sampling_failed,
            path=outcome.path,
            stage_ms=outcome.stage_ms,
        )

    def blocks_to_grant(self, plan: StepPlan) -> dict[str, int]:
        """How many more blocks each request the plan runs needs beyond its
        table and the plan's grants (what a scheduler grants; for drivers of
        an engine alone, see ``local_blocks.py``). Raises PlanError as ``step``."""
        _admitted, _works, growth, _failed = self._validate(plan)
        return {
            request_id: missing
            for request_id, missing in self._missing_blocks(plan, growth).items()
            if missing > 0
        }

    def fail_requests(self, request_ids: list[str], message: str) -> list[RequestFailure]:
        """End these requests here (their K/V goes back to the pool; later work
        planned for them is skipped); one failure per request the engine held."""
        failed = [RequestFailure(rid, message) for rid in request_ids if rid in self._requests]
        for failure in failed:
            self._end(failure.request_id)
        return failed

    def _admit(self, spec: RequestSpec) -> _Request:
        sampling = spec.sampling
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(self.model.config.eos_token_ids)
        return _Request(
            spec=spec,
            seed=sampling.seed if sampling.seed is not None else secrets.randbits(63),
            stop_token_ids=frozenset(stop_ids),
            num_generated=spec.num_generated,
            num_cached_tokens=spec.num_cached_tokens,
        )

    def _validate(
        self, plan: StepPlan
    ) -> tuple[list[_Request], list[_Work], dict[str, int], list[RequestFailure]]:
        """Check the whole plan before touching any state.

        Returns the requests it admits, the work of the step, the total K/V
        tokens each worked-on request will hold, and the requests that end
        here because of their own input (left out of the rest).
        """
        released = set(plan.released_request_ids)
        known = {rid: req for rid, req in self._requests.items() if rid not in released}
        admitted = []
        for spec in plan.new_requests:
            if spec.request_id in known:
                raise PlanError(f"request {spec.request_id!r} is already running here")
            if spec.num_prompt_tokens < 1 or spec.sampling.max_tokens < 1:
                raise PlanError(f"request {spec.request_id!r} needs a prompt and max_tokens >= 1")
            if not 0 <= spec.num_cached_tokens < spec.num_prompt_tokens:
                raise PlanError(
                    f"request {spec.request_id!r}: {spec.num_cached_tokens} cached tokens of a "
                    f"{spec.num_prompt_tokens}-token prompt (at least one must be computed)"
                )
            known[spec.request_id] = self._admit(spec)
            admitted.append(known[spec.request_id])
        works: list[_Work] = []
        seen: set[str] = set()
        failures: dict[str, str] = {}
        num_embeddings = self._num_embeddings
        for chunk in plan.prefill_chunks:
            if chunk.request_id in self._recently_ended and chunk.request_id not in known:
                continue  # failed in a step whose result the scheduler had not seen
            request = self._lookup(known, chunk.request_id, seen)
            end = chunk.start_position + len(chunk.token_ids)
            if chunk.start_position != request.num_cached_tokens:
                raise PlanError(
                    f"request {chunk.request_id!r}: chunk starts at {chunk.start_position} "
                    f"but {request.num_cached_tokens} tokens are cached"
                )
            if not chunk.token_ids or end > request.spec.num_prompt_tokens:
                raise PlanError(
                    f"request {chunk.request_id!r}: chunk [{chunk.start_position}, {end}) is empty "
                    f"or past its {request.spec.num_prompt_tokens} prompt tokens"
                )
            if min(chunk.token_ids) < 0 or max(chunk.token_ids) >= num_embeddings:
                failures[chunk.request_id] = (
                    f"the prompt holds a token id outside the model's vocabulary "
                    f"(0 to {num_embeddings - 1})"
                )
                continue
            samples = end == request.spec.num_prompt_tokens
            works.append(_Work(request, chunk.token_ids, chunk.start_position, samples))
        for request_id in plan.decode_request_ids:
            if request_id in self._recently_ended and request_id not in known:
                continue  # ended in a step whose result the scheduler had not seen
            request = self._lookup(known, request_id, seen)
            if not request.prompt_done or request.last_token_id is None:
                raise PlanError(f"request {request_id!r} cannot decode before its prompt is done")
            works.append(_Work(request, [request.last_token_id], request.num_cached_tokens, True))
        limit = self.model.config.max_position_embeddings
        growth = {}
        for work in works:
            end = work.start_position + len(work.token_ids)
            if end > limit:
                failures[work.request.spec.request_id] = (
                    f"the request reaches position {end}, past the model's context of {limit}"
                )
                continue
            growth[work.request.spec.request_id] = end
        works = [work for work in works if work.request.spec.request_id not in failures]
        # A request that fails in the plan that admits it is never admitted.
        admitted = [r for r in admitted if r.spec.request_id not in failures]
        failed = [RequestFailure(rid, message) for rid, message in failures.items()]
        return admitted, works, growth, failed

    def _missing_blocks(self, plan: StepPlan, growth: dict[str, int]) -> dict[str, int]:
        """Blocks each request of ``growth`` (id -> tokens it holds after the
        step) lacks after the plan's releases and grants (negative: spare)."""
        tables = self.kv_cache.tables
        released = set(plan.released_request_ids)
        grants = plan.block_grants
        return {
            request_id: blocks_for(num_tokens, tables.block_size)
            - (0 if request_id in released else tables.num_held(request_id))
            - len(grants.get(request_id, ()))
            for request_id, num_tokens in growth.items()
        }

    def _check_grants(self, plan: StepPlan, growth: dict[str, int]) -> None:
        """Every granted block exists, and every slot the step writes lies in a
        granted block; else PlanError (nothing changed yet)."""
        num_blocks = self.num_blocks
        for request_id, block_ids in plan.block_grants.items():
            if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_blocks):
                raise PlanError(
                    f"request {request_id!r} is granted a block outside 0 to {num_blocks - 1}"
                )
        for request_id, missing in self._missing_blocks(plan, growth).items():
            if missing > 0:
                raise PlanError(
                    f"request {request_id!r} needs {missing} more K/V blocks than it was granted"
                )
        for spec in plan.new_requests:
            num_granted = len(plan.block_grants.get(spec.request_id, ()))
            if spec.num_cached_tokens > num_granted * self.block_size:
                raise PlanError(
                    f"request {spec.request_id!r} has {spec.num_cached_tokens} cached tokens "
                    f"in {num_granted} granted blocks"
                )

    @staticmethod
    def _lookup(known: dict[str, _Request], request_id: str, seen: set[str]) -> _Request:
        if request_id not in known:
            raise PlanError(f"request {request_id!r} is not running here")
        if request_id in seen:
            raise PlanError(f"request {request_id!r} appears twice in one plan")
        seen.add(request_id)
        return known[request_id]

    def _record(self, request: _Request, token_id: int) -> SampledToken:
        index = request.num_generated
        spec = request.spec
        # The placement's first token says how much of its prompt was cached.
        num_cached_tokens = spec.num_cached_tokens if index == spec.num_generated else None
        request.num_generated += 1
        request.last_token_id = token_id
        finish_reason: FinishReason | None = None
        if token_id in request.stop_token_ids:
            finish_reason = "stop"
        elif request.num_generated >= request.spec.sampling.max_tokens:
            finish_reason = "length"
        if finish_reason is not None:
            self._end(request.spec.request_id)
        return SampledToken(
            request_id=request.spec.request_id,
            token_id=token_id,
            index=index,
            finish_reason=finish_reason,
            num_cached_tokens=num_cached_tokens,
        )

    def _end(self, request_id: str) -> None:
        """A request finished or failed here: drop it, and skip work planned for it since."""
        self._drop(request_id)
        self._recently_ended[request_id] = None
        if len(self._recently_ended) > _RECENTLY_ENDED_LIMIT:
            self._recently_ended.popitem(last=False)

    def _drop(self, request_id: str) -> None:
        """Forget a request and free its blocks; a no-op for unknown ids (idempotent)."""
        self._requests.pop(request_id, None)
        self.kv_cache.tables.forget(request_id)
