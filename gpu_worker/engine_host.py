"""Where a worker's engine runs: a thread of the worker's process, or a
process of its own.

The worker's event loop (Redis I/O: reading plans, publishing steps) and the
engine's step loop are both Python, and in one process they share one GIL:
on a CPU, or beside a GPU with a small model, the engine's host work waits
for the loop's and a forward pass takes up to twice as long as alone
(``bench/control_plane.py``). So ``python -m gpu_worker`` runs the engine in a
child process (``EngineProcess``: spawned, the model loaded there, plans in
and ``StepDone``s out over a pipe as MessagePack, dying with its parent); the
in-process ``EngineThread`` serves tests and tools that hold an ``Engine``.

Both run a ``PlanRunner`` over the plans in the order submitted and hand each
``StepDone`` to the loop; ``num_in_flight`` counts plans submitted and not
yet done (0: the engine is idle).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import functools
import multiprocessing
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import structlog

from gpu_worker.engine_stats import EngineStats
from gpu_worker.pipeline_layout import free_local_port, local_ranks, world_size
from gpu_worker.step_done import StepDone
from shared.messages import StepPlan
from shared.parent_death import die_with_parent
from shared.settings import WorkerSettings

if TYPE_CHECKING:  # torch is imported where an engine runs, not in the Redis shell
    from gpu_worker.engine import Engine, PathsChanged

_log = structlog.get_logger(__name__)


# How long an OpenMP thread of the engine spins at a barrier before it sleeps
# (libgomp's GOMP_SPINCOUNT), unless the worker's environment says how to wait
# (OMP_WAIT_POLICY or GOMP_SPINCOUNT). A forward pass is hundreds of parallel
# regions a few microseconds of Python apart: threads that sleep at every
# barrier (OMP_WAIT_POLICY=PASSIVE) decoded SmolLM2 at 13-18 tokens/s against
# 27-29 with this spin (2-core EPYC, 2 threads, float16 weights; docs/history/
# benchmarks-notebook.md, *the CPU default, float16 matrices and a brief OpenMP
# spin*). libgomp's own default spins 10x longer, which once made a
# forward pass 4x slower beside a tokenizing gateway on the same two cores
# (tests/adversarial/test_event_loop.py); with this spin that test's stream
# is no slower under attack than with PASSIVE.
# How long a stopping worker waits for its engine process to end by itself
# (after its current step) before killing it; and, at the shell's exit, how long
# an engine process still there gets (one that failed to start is ending).
ENGINE_EXIT_WAIT_S = 10.0
ENGINE_AT_EXIT_WAIT_S = 2.0
OPENMP_SPIN_COUNT = "30000"
OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def engine_environment_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """What the engine process adds to ``environ``: the spin count, unless
    ``environ`` already says how OpenMP threads wait."""
    if any(name in environ for name in OPENMP_WAIT_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}


@contextlib.contextmanager
def _child_environment(defaults: dict[str, str]) -> Iterator[None]:
    """``defaults`` in the environment a child spawned now inherits (values
    already set win), then the environment as it was."""
    added = {name: value for name, value in defaults.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


class PlanJob(msgspec.Struct, frozen=True):
    """One plan for the engine, as read (``received_at``: ``time.time()``)."""

    entry_id: bytes
    plan: StepPlan
    received_at: float


class EngineReady(msgspec.Struct, frozen=True, tag="ready"):
    """The engine process loaded its model: its K/V pool's shape."""

    num_blocks: int
    block_size: int


class EngineFailed(msgspec.Struct, frozen=True, tag="failed"):
    """The engine process could not start (the model did not load)."""

    message: str


class EngineProcessDied(RuntimeError):
    """The engine process ended without being asked to."""


class EngineStartFailed(EngineProcessDied):
    """The engine could not start; the message says why (for a setting the
    user can change, such as the K/V pool's size, all there is to say)."""


class PathsInUse(msgspec.Struct, frozen=True, tag="paths"):
    """The step paths the engine serves on now, by name, and whether more are
    being compiled (``path_compiler.py``); sent whenever they change."""

    paths: list[str]
    compiling: bool


_FROM_CHILD = msgspec.msgpack.Decoder(EngineReady | EngineFailed | PathsInUse)
_JOB = msgspec.msgpack.Decoder(PlanJob | None)
_DONE = msgspec.msgpack.Decoder(StepDone | PathsInUse)
_encoder = msgspec.msgpack.Encoder()


class EngineHost(Protocol):
    """What the worker actor needs of where its engine runs."""

    num_blocks: int
    block_size: int
    stats: EngineStats

    @property
    def num_in_flight(self) -> int:
        """Plans submitted and not yet done."""
        ...

    async def start(self) -> None:
        """Be ready to take plans (a process loads its model first)."""
        ...

    def submit(self, job: PlanJob) -> None:
        """Queue one plan; never blocks the loop for long."""
        ...

    async def run(self, stop: asyncio.Event, done: asyncio.Queue[StepDone | None]) -> None:
        """Run the submitted plans in order into ``done`` until ``close`` (or
        ``stop``: plans not yet started stay unrun); ``done`` then gets None."""
        ...

    def close(self) -> None:
        """No more plans."""
        ...


def build_engine(settings: WorkerSettings, on_paths_changed: PathsChanged | None = None) -> Engine:
    """The model on its device and a K/V pool of the configured size
    (``on_paths_changed``: told of each change of the step paths in use)."""
    from gpu_worker.attention import default_backend_name
    from gpu_worker.compile_cache_warmer import WarmerSpec, warm_compile_cache
    from gpu_worker.device import inductor_cache_dir
    from gpu_worker.engine import Engine
    from gpu_worker.kv_cache import KVCacheBudget, KVCacheSizeError
    from gpu_worker.model_loading import load_model
    from gpu_worker.quantized_linear import weight_format_of

    # Compiled graphs kept beside the prepared models, so a restart reuses them.
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir(settings.model.cache_dir))
    )
    try:
        budget = KVCacheBudget(
            num_bytes=settings.kv_cache_bytes,
            fraction=settings.kv_cache_fraction,
            block_size=settings.block_size,
            max_sequences=settings.kv_cache_max_sequences,
        )
        model = load_model(
            settings.model.model_dir, settings.device, settings.dtype, settings.weight_format
        )
        # The first compile of the paths built while serving, in a process of its own.
        warmer = WarmerSpec(
            settings.model.model_dir,
            str(model.dtype).removeprefix("torch."),
            weight_format_of(model.weights),
            settings.attention_backend or default_backend_name(model.device),
        )
        # The pool is sized from the memory left once the model is loaded.
        return Engine(
            model,
            budget,
            settings.attention_backend,
            worker_id=settings.worker_id,
            use_cuda_graphs=settings.cuda_graphs,
            compile_decode=settings.compile_decode,
            compile_in_background=settings.serve_while_compiling,
            on_paths_changed=on_paths_changed,
            warm_compile_cache=(
                functools.partial(warm_compile_cache, warmer)
                if settings.serve_while_compiling
                else None
            ),
        )
    except KVCacheSizeError as error:
        raise EngineStartFailed(str(error)) from None


def _take_paths(stats: EngineStats, message: PathsInUse) -> None:
    stats.live_paths = message.paths
    stats.compiling_paths = message.compiling


def _count(stats: EngineStats, done: StepDone) -> None:
    if done.counters is not None:
        stats.num_steps = done.counters.num_steps
        stats.num_tokens = done.counters.num_tokens
        stats.busy_s = done.counters.busy_s


class EngineThread:
    """The engine on one dedicated thread of this process."""

    def __init__(self, engine: Engine, worker_id: str) -> None:
        self.engine = engine
        self.num_blocks = engine.num_blocks
        self.block_size = engine.block_size
        self.stats = engine.stats
        from gpu_worker.plan_runner import PlanRunner

        self._runner = PlanRunner(engine, worker_id)
        self._jobs: queue.SimpleQueue[PlanJob | None] = queue.SimpleQueue()
        self._num_submitted = 0
        self._num_done = 0

    @property
    def num_in_flight(self) -> int:
        """Plans submitted and not yet done."""
        return self._num_submitted - self._num_done

    async def start(self) -> None:
        """Nothing to load: the engine is here."""

    def submit(self, job: PlanJob) -> None:
        """Queue one plan for the engine thread."""
        self._num_submitted += 1
        self._jobs.put_nowait(job)

    def close(self) -> None:
        """No more plans."""
        self._jobs.put_nowait(None)

    async def run(self, stop: asyncio.Event, done: asyncio.Queue[StepDone | None]) -> None:
        """The engine thread, owned by this task: plans back to back."""
        loop = asyncio.get_running_loop()

        def finished(item: StepDone) -> None:
            self._num_done += 1
            done.put_nowait(item)

        def steps() -> None:
            try:
                while (job := self._jobs.get()) is not None and not stop.is_set():
                    item = self._runner.run(job.entry_id, job.plan, job.received_at)
                    loop.call_soon_threadsafe(finished, item)
            finally:
                # Plans left unrun stay pending; the scheduler recomputes their requests.
                loop.call_soon_threadsafe(done.put_nowait, None)

        await asyncio.to_thread(steps)


class EngineProcess:
    """The engine in a child process of its own (its own GIL), fed over a pipe.

    Plans go down the pipe without ever blocking the event loop
    (``_PlanWriter``): a pipe holds a few hundred KB, and a plan of long whole
    prompts (``orca``) written while the engine runs a long step would
    otherwise stall the loop (publishing, heartbeats) until the engine reads it.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        if world_size(settings) > 1 and settings.rendezvous is None:
            # Every rank here: they meet on this host.
            settings = dataclasses.replace(settings, rendezvous=f"127.0.0.1:{free_local_port()}")
        self.settings = settings
        self.num_blocks = 0
        self.block_size = 0
        self.stats = EngineStats()
        self._context = multiprocessing.get_context("spawn")
        # The stages behind the first that run on this host (a worker group's).
        self._stage_processes = [
            self._context.Process(
                target=_spawned_stage_main,
                args=(settings, rank),
                name=f"engine-{settings.worker_id}-rank{rank}",
                daemon=True,
            )
            for rank in local_ranks(settings)
            if rank != 0
        ]
        self._connection, child_end = self._context.Pipe(duplex=True)
        self._process = self._context.Process(
            target=engine_process_main,
            args=(settings, child_end),
            name=f"engine-{settings.worker_id}",
            daemon=True,
        )
        self._child_end = child_end
        self._writer = _PlanWriter(self._connection.fileno())
        self._num_submitted = 0
        self._num_done = 0
        self._closed = False

    @property
    def num_in_flight(self) -> int:
        """Plans submitted and not yet done."""
        return self._num_submitted - self._num_done

    async def start(self) -> None:
        """Spawn the engine process and wait until its model is loaded."""
        with _child_environment(engine_environment_defaults(os.environ)):
            self._process.start()
            for process in self._stage_processes:
                process.start()
        # multiprocessing's own exit handler would SIGTERM it (ignored: the shell
        # decides when it stops) and then join it with no limit.
        atexit.register(self._end_process, ENGINE_AT_EXIT_WAIT_S)
        self._child_end.close()  # the child holds its end now
        message: EngineReady | EngineFailed | PathsInUse | None = None
        while message is None or isinstance(message, PathsInUse):
            if message is not None:
                _take_paths(self.stats, message)
            try:
                data = await asyncio.to_thread(self._connection.recv_bytes)
            except EOFError as error:
                raise EngineProcessDied("the engine process ended while loading") from error
            message = _FROM_CHILD.decode(data)
        if isinstance(message, EngineFailed):
            await asyncio.to_thread(self._end_process, ENGINE_EXIT_WAIT_S)  # it is ending
            raise EngineStartFailed(f"the engine did not start: {message.message}")
        self.num_blocks, self.block_size = message.num_blocks, message.block_size
        _log.info("engine_process_started", pid=self._process.pid)

    def submit(self, job: PlanJob) -> None:
        """Send one plan to the engine process (what the pipe cannot take now
        goes once it can)."""
        self._num_submitted += 1
        self._writer.send(_encoder.encode(job))

    def close(self) -> None:
        """No more plans: the engine process ends after the ones submitted."""
        if not self._closed:
            self._closed = True
            self._writer.send(_encoder.encode(None))

    def _end_process(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the engine process (and a group's stages here) to
        end by themselves, then kill what is left."""
        deadline = time.monotonic() + wait_s
        for process in [self._process, *self._stage_processes]:
            if process.pid is None:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                _log.warning("engine_process_killed", pid=process.pid)
                process.kill()
                process.join(ENGINE_EXIT_WAIT_S)

    async def run(self, stop: asyncio.Event, done: asyncio.Queue[StepDone | None]) -> None:
        """Hand every StepDone the engine process sends to ``done`` until it ends."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                data = self._connection.recv_bytes()
            except (EOFError, OSError):
                loop.remove_reader(self._connection.fileno())
                if not ended.done():
                    ended.set_result(None)
                return
            item = _DONE.decode(data)
            if isinstance(item, PathsInUse):
                _take_paths(self.stats, item)
                return
            self._num_done += 1
            _count(self.stats, item)
            done.put_nowait(item)

        loop.add_reader(self._connection.fileno(), readable)
        stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        waiting: list[asyncio.Future[Any]] = [ended, stopping]
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not ended.done():
                # Asked to stop: the engine ends after its current step.
                self.close()
                await asyncio.wait_for(asyncio.shield(ended), timeout=30)
        finally:
            asked_to_end = self._closed
            stopping.cancel()
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self._connection.fileno())
            done.put_nowait(None)
            # Cancelled too (Redis gone for good): the end goes down the pipe
            # before it is dropped, whichever of the worker's tasks ends first.
            self.close()
            self._writer.discard()  # what the engine did not take stays unrun
            await asyncio.to_thread(self._end_process, ENGINE_EXIT_WAIT_S)
        if not asked_to_end:
            raise EngineProcessDied(f"the engine process exited ({self._process.exitcode})")


class _PlanWriter:
    """Messages down one end of a multiprocessing pipe (its framing: a
    big-endian length, then the bytes) without blocking the event loop: each
    write takes what the socket can hold now (``MSG_DONTWAIT``: the socket
    itself stays blocking, as the connection's reads need); the rest waits,
    in order, and goes when the loop sees the socket writable."""

    def __init__(self, fileno: int) -> None:
        # A duplicate descriptor of the same socket, for send(); the
        # connection keeps its own for reading.
        self._socket = socket.socket(fileno=os.dup(fileno))
        self._pending: deque[memoryview] = deque()
        self._waiting_for_room = False
        self._broken = False

    def send(self, payload: bytes) -> None:
        """Frame and send ``payload``, or queue what does not fit now."""
        if self._broken:
            return  # the engine process is gone: its end is seen by the reader
        size = len(payload)
        # Over 2 GiB the length goes as -1 then 8 bytes, as Connection.send_bytes does.
        header = struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size)
        self._pending.append(memoryview(header + payload))
        if not self._waiting_for_room:
            self._flush()

    def discard(self) -> None:
        """Drop what is not sent yet and stop waiting for room."""
        self._pending.clear()
        self._stop_waiting()
        self._socket.close()

    def _flush(self) -> None:
        pending = self._pending
        while pending:
            try:
                sent = self._socket.send(pending[0], socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except BlockingIOError:
                self._wait_for_room()
                return
            except OSError:
                self._broken = True
                pending.clear()
                break
            if sent == len(pending[0]):
                pending.popleft()
            else:
                pending[0] = pending[0][sent:]
        self._stop_waiting()

    def _wait_for_room(self) -> None:
        if not self._waiting_for_room:
            asyncio.get_running_loop().add_writer(self._socket.fileno(), self._flush)
            self._waiting_for_room = True

    def _stop_waiting(self) -> None:
        if self._waiting_for_room:
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                asyncio.get_running_loop().remove_writer(self._socket.fileno())
            self._waiting_for_room = False


def engine_process_main(settings: WorkerSettings, connection: Connection) -> None:
    """The engine process: load the model, then run each plan sent until None."""
    die_with_parent()  # the worker's shell, whatever kills it (kill -9 included)
    # The shell decides when to stop; a Ctrl-C to the group must not end us first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from shared.log import configure_logging

    configure_logging("worker")
    # The compiler's thread tells of new paths while this one sends steps' results.
    sending = threading.Lock()

    def send(message: EngineReady | EngineFailed | PathsInUse | StepDone) -> None:
        with sending:
            connection.send_bytes(_encoder.encode(message))

    def paths_changed(paths: list[str], compiling: bool) -> None:
        with contextlib.suppress(OSError):  # the shell is gone: this process ends soon
            send(PathsInUse(paths, compiling))

    if world_size(settings) > 1:
        _serve_first_stage(settings, connection, send)
        return
    try:
        engine = build_engine(settings, paths_changed)
    except EngineStartFailed as error:  # a setting to change: the message says it all
        _log.error("engine_failed_to_start", error=str(error))
        send(EngineFailed(str(error)))
        return
    except Exception as error:  # a model that does not load: the shell reports it
        _log.exception("engine_failed_to_start")
        send(EngineFailed(str(error)))
        return
    send(EngineReady(engine.num_blocks, engine.block_size))
    from gpu_worker.plan_runner import PlanRunner

    runner = PlanRunner(engine, settings.worker_id)
    while True:
        try:
            job = _JOB.decode(connection.recv_bytes())
        except EOFError:
            return
        if job is None:
            return
        send(runner.run(job.entry_id, job.plan, job.received_at))


def _serve_first_stage(
    settings: WorkerSettings,
    connection: Connection,
    send: Callable[[EngineReady | EngineFailed | PathsInUse | StepDone], None],
) -> None:
    """The engine process of a worker group's rank 0: join the group, then drive its
    pipeline (``pipeline_driver.py``); exit status 1 where a rank is lost."""
    from gpu_worker.attention import default_backend_name
    from gpu_worker.engine import Engine
    from gpu_worker.pipeline_driver import PIPELINE_PATH, PipelineDriver
    from gpu_worker.pipeline_stage import PipelineStage
    from gpu_worker.plan_runner import PlanRunner
    from gpu_worker.worker_group import GroupStartError, join_group

    try:
        member = join_group(settings, 0)
        engine = Engine(
            member.model, member.kv_size, settings.attention_backend, worker_id=settings.worker_id
        )
    except GroupStartError as error:  # every rank was told the same
        _log.error("group_failed_to_start", rank=0, error=str(error))
        send(EngineFailed(str(error)))
        return
    except Exception as error:
        _log.exception("engine_failed_to_start")
        send(EngineFailed(str(error)))
        return
    send(PathsInUse([PIPELINE_PATH], False))
    send(EngineReady(engine.num_blocks, engine.block_size))
    backend_name = settings.attention_backend or default_backend_name(member.model.device)
    stage = PipelineStage(member.model, engine.kv_cache, backend_name, first=True, last=member.last)
    driver = PipelineDriver(PlanRunner(engine, settings.worker_id), member, stage, send)
    try:
        driver.serve(connection, _JOB.decode)
    except Exception as error:  # a rank is gone (gloo's wait broke): the group is lost
        _log.error("worker_group_lost", rank=0, error=str(error).splitlines()[0])
        sys.exit(1)


def _spawned_stage_main(settings: WorkerSettings, rank: int) -> None:
    """A stage behind the first, spawned by this host's shell (``pipeline_stage_loop.py``)."""
    from gpu_worker.pipeline_stage_loop import stage_process_main

    sys.exit(stage_process_main(settings, rank))
