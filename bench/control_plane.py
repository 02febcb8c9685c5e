"""The control plane's cost without a GPU: the live service beside the engine alone.

    python -m bench.control_plane [--batch 32,64] [--duration-s 30] [--context 256]
                                  [--prompt-tokens 16] [--max-inflight N] [--threads N]
                                  [--pin-engine] [--wait-quiet-s S] [--retries N] [--quick]
                                  [--out bench/results/control_plane.json]

The model is a tiny random-weight Llama (``TINY_LLAMA``: one layer, width 64,
a vocabulary of 2,048 under SmolLM2's tokenizer; prompts go as token ids)
written once under the cache folder, so that a CPU step takes a few
milliseconds at batch 32-64, about what a GPU step of a real model takes: the
control plane's share is then about as large as it would be beside a GPU.
Per batch size B, in one run:

1. **engine alone**: ``Engine.step`` driven in this process with the service's
   load (B requests, each a ``--prompt-tokens`` prompt then ``max_tokens =
   2 * (context - prompt)`` greedy tokens, a new one admitted as one ends, so
   the mean attended context is ``--context``); then one plain decode step of
   B requests at exactly ``--context``; once before the service and once
   after, and the two averaged (this machine's speed drifts);
2. **the service**: ``orcapod up`` (scheduler ``--max-batch-size B``) on a
   private Redis, driven over websockets by B + B/8 closed-loop clients (the
   extra ones wait in the scheduler's queue, so the batch stays full); over a
   ``--duration-s`` window after a warm-up it reads the stats hash (the
   ``timing:*`` segments of every step, the worker's counters), Redis's
   ``INFO commandstats`` and ``INFO stats``, and the CPU time of every
   process of the benchmark, and of the machine (what is left is "other":
   somebody else's work, which makes a window's numbers unreliable).

``--pin-engine`` stands in for a GPU more closely: the engine (the engine
process, and this process while it runs the engine alone) gets one CPU of
its own and every other process of the benchmark the rest, as the device
would be the engine's alone (use it with ``--threads 1``).
``--threads`` sets torch's threads here and in the worker (OMP_NUM_THREADS);
``--wait-quiet-s`` waits before each window for other processes to leave the
CPUs, ``--retries`` measures a disturbed window again. Prints Markdown
tables and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import redis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench.machine import torch_machine
from bench.output import RESULTS_DIR, write_json
from bench.timing import median_s
from shared.keys import RedisKeys
from shared.protocol import (
    Cancel,
    Done,
    Error,
    Generate,
    Token,
    decode_server_message,
    encode_json,
)
from shared.settings import DEFAULT_PREFIX, embedded_model_dir, model_location

# One layer of width 64: the step is mostly the engine's host work per request
# (about 70 µs), 4-6 ms at batch 32-64 on two cores.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    # Below the tokenizer's 49,152, so every id is one the gateway detokenizes.
    "vocab_size": 2048,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
MODEL_FOLDER = "control-plane-model"
KV_CACHE_BYTES = 256 << 20
REQUESTS_PER_SOCKET = 16
FIRST_TOKEN_ID = 3  # below: special tokens
TOKEN_FRAME_PREFIX = '{"type":"token"'
STOP_WAIT_S = 10.0
# CPU of processes outside the benchmark over which a window counts as disturbed.
BUSY_MACHINE_CORES = 0.2
# Segments of a step's life, as the scheduler sums them (scheduler_actor/step_timing.py).
STEP_SEGMENTS = ("plan_transit_s", "plan_queued_s", "worker_host_s", "forward_s",
                 "result_transit_s")  # fmt: skip
TURN_SEGMENTS = ("turn_s", "turn_commit_s")
NET_BYTES = ("total_net_input_bytes", "total_net_output_bytes")
ROLES = ("engine", "worker", "gateway", "scheduler", "redis", "launcher", "load generator")
Row = dict[str, Any]


# --- the model --------------------------------------------------------------------


def ensure_model(cache_dir: Path, tokenizer_dir: Path) -> Path:
    """The tiny model's folder (config, SmolLM2's tokenizer, random float32 weights),
    written once; rewritten when ``TINY_LLAMA`` changed."""
    model_dir = cache_dir / MODEL_FOLDER
    config_text = json.dumps(TINY_LLAMA, indent=2) + "\n"
    config_path = model_dir / "config.json"
    weights = model_dir / "model.safetensors"
    if weights.is_file() and config_path.is_file() and config_path.read_text() == config_text:
        return model_dir
    import torch
    from safetensors.torch import save_file

    from bench.random_checkpoint import random_checkpoint
    from gpu_worker.model_config import load_model_config

    staging = Path(tempfile.mkdtemp(prefix=MODEL_FOLDER, dir=cache_dir))
    for source in tokenizer_dir.iterdir():
        if source.name.startswith("tokenizer") or source.name == "special_tokens_map.json":
            shutil.copy(source, staging / source.name)
    (staging / "config.json").write_text(config_text)
    config = load_model_config(staging, with_weights=False)
    tensors = random_checkpoint(config, torch.float32, seed=0)
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(model_dir, ignore_errors=True)
    staging.rename(model_dir)
    return model_dir


def tokenizer_source(cache_dir: Path) -> Path:
    """SmolLM2's prepared folder (prepared now if missing), for its tokenizer files."""
    source = embedded_model_dir(cache_dir)
    if not source.is_dir():
        from gpu_worker.model_prepare import prepare_model

        print("preparing the embedded model (once), for its tokenizer...", flush=True)
        prepare_model(cache_dir)
    return source


# --- the engine alone -------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """B requests in flight, each ``prompt_tokens`` then ``max_tokens`` greedy tokens."""

    batch: int
    prompt_tokens: int
    max_tokens: int
    vocab_size: int

    def first_max_tokens(self, index: int) -> int:
        """The first request of client ``index`` ends early, spread over one request's
        life, so requests end one at a time from the start (no waves)."""
        return 1 + index * self.max_tokens // max(self.batch, 1)

    def prompt(self, rng: random.Random) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(self.prompt_tokens)]


def engine_alone(model_dir: Path, workload: Workload, context: int, duration_s: float) -> Row:
    """``Engine.step`` under the service's load for ``duration_s``, then one decode
    step of the batch at exactly ``context`` (median of 20)."""
    from gpu_worker.engine import Engine
    from gpu_worker.kv_cache import KVCacheBudget
    from gpu_worker.model_loading import load_model
    from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan

    engine = Engine(load_model(model_dir, "cpu", "float32"), KVCacheBudget(KV_CACHE_BYTES))
    rng = random.Random(0)
    running: set[str] = set()
    num_admitted = 0
    # A free list, as the scheduler keeps: each request gets its whole life's
    # blocks when admitted and gives them back when it finishes.
    free_blocks = list(range(engine.num_blocks))
    blocks_of: dict[str, list[int]] = {}

    def admit(max_tokens: int) -> tuple[RequestSpec, PrefillChunk]:
        nonlocal num_admitted
        request_id = f"e{num_admitted}"
        num_admitted += 1
        running.add(request_id)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        prompt_ids = workload.prompt(rng)
        spec = RequestSpec(request_id, len(prompt_ids), sampling)
        num_blocks = -(-(len(prompt_ids) + max_tokens) // engine.block_size)
        blocks_of[request_id] = [free_blocks.pop() for _ in range(num_blocks)]
        return spec, PrefillChunk(request_id, prompt_ids, 0)

    def step(index: int, fresh: list[tuple[RequestSpec, PrefillChunk]]) -> tuple[int, float]:
        decode_ids = sorted(running - {spec.request_id for spec, _ in fresh})
        plan = StepPlan(
            "bench",
            0,
            index,
            new_requests=[spec for spec, _ in fresh],
            prefill_chunks=[chunk for _, chunk in fresh],
            decode_request_ids=decode_ids,
            block_grants={spec.request_id: blocks_of[spec.request_id] for spec, _ in fresh},
        )
        output = engine.step(plan)
        for request_id in output.finished_request_ids:
            running.discard(request_id)
            free_blocks.extend(blocks_of.pop(request_id))
        return len(output.tokens), output.step_ms / 1000

    step_index, num_tokens, forward_s, num_steps = 0, 0, 0.0, 0
    # The first requests, then keep B running: the warm-up is one request's life.
    step(0, [admit(workload.first_max_tokens(i)) for i in range(workload.batch)])
    started = time.perf_counter()
    warm_until = started + min(duration_s, 2.0)
    window_started = 0.0
    while True:
        now = time.perf_counter()
        if not window_started and now >= warm_until:
            window_started, num_tokens, forward_s, num_steps = now, 0, 0.0, 0
            own_cpu_s, busy_s = process_cpu_s(os.getpid()), machine_busy_s()
        if window_started and now >= window_started + duration_s:
            break
        step_index += 1
        fresh = [admit(workload.max_tokens) for _ in range(workload.batch - len(running))]
        tokens, step_forward_s = step(step_index, fresh)
        num_tokens += tokens
        forward_s += step_forward_s
        num_steps += 1
    wall_s = time.perf_counter() - window_started
    own_s = process_cpu_s(os.getpid()) - own_cpu_s
    decode = fixed_context_decode_ms(engine, workload.batch, context, running)
    # Over the decode steps too: both are what a disturbance would spoil.
    other_s = machine_busy_s() - busy_s - (process_cpu_s(os.getpid()) - own_cpu_s)
    other_wall_s = time.perf_counter() - window_started
    return {
        "num_steps": num_steps,
        "step_ms": wall_s * 1000 / num_steps,
        "forward_ms": forward_s * 1000 / num_steps,
        "tokens_per_s": num_tokens / wall_s,
        "decode_at_context_ms": decode,
        "cpu_cores": own_s / wall_s,
        "other_cores": max(0.0, other_s / other_wall_s),
    }


def fixed_context_decode_ms(engine: Any, batch: int, context: int, released: set[str]) -> float:
    """One decode step of ``batch`` requests that each attend exactly ``context`` tokens
    (median of 20): ``released`` go first, the new ones are prefilled eight at a time."""
    from bench.engine_plans import decode_plan, prefill_in_groups, release_plan, rewind

    engine.step(release_plan(sorted(released)))
    request_ids = [f"d{i}" for i in range(batch)]
    prefill_in_groups(engine, {rid: [FIRST_TOKEN_ID] * (context - 1) for rid in request_ids})
    step = partial(engine.step, decode_plan(request_ids))
    return median_s(step, 20, partial(rewind, engine, request_ids, context - 1)) * 1000


# --- what the service reports -----------------------------------------------------


def stats_fields(raw: Mapping[bytes | str, bytes | str]) -> dict[str, float]:
    """The stats hash (HGETALL) as numbers, by field name."""
    fields: dict[str, float] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else key
        with contextlib.suppress(ValueError):
            fields[name] = float(value)
    return fields


def command_stats(commandstats: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``INFO commandstats`` as redis-py parses it (``cmdstat_xadd: {calls, usec, ...}``)
    as calls and µs of Redis time per command (``xadd``, ``client|setname``)."""
    commands = {}
    for key, value in commandstats.items():
        if key.startswith("cmdstat_") and isinstance(value, Mapping):
            commands[key.removeprefix("cmdstat_")] = {
                "calls": float(value.get("calls", 0)),
                "usec": float(value.get("usec", 0)),
            }
    return commands


def deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` per key of ``after`` (a key new in ``after`` counts from 0)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def command_deltas(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    """Calls and µs per command over a window; commands not called in it are left out."""
    window = {}
    for name, counts in after.items():
        change = deltas(before.get(name, {}), counts)
        if change.get("calls", 0) > 0:
            window[name] = change
    return window


def gap_median_ms(stats: Mapping[str, float], worker_id: str) -> float | None:
    """The upper edge (ms) of the step-gap histogram bucket holding the median gap."""
    prefix = f"{worker_id}:step_gap_le_us:"
    buckets = sorted(
        (float(name.removeprefix(prefix)), count)
        for name, count in stats.items()
        if name.startswith(prefix) and count > 0
    )
    total = sum(count for _, count in buckets)
    seen = 0.0
    for edge_us, count in buckets:
        seen += count
        if seen >= total / 2:
            return edge_us / 1000
    return None


@dataclass(frozen=True)
class Snapshot:
    """Every counter the window is measured by, read at one moment."""

    at_s: float  # time.perf_counter()
    stats: dict[str, float]
    commands: dict[str, dict[str, float]]
    net_bytes: dict[str, float]  # total_net_input_bytes, total_net_output_bytes
    cpu_s: dict[str, float]  # CPU seconds used so far, per role
    machine_busy_s: float  # CPU seconds of every process on the machine
    num_tokens_received: int


def service_row(before: Snapshot, after: Snapshot, worker_id: str) -> Row:
    """Throughput, the per-step time segments (ms), Redis work per step and CPU (cores)
    over the window between two snapshots."""
    wall_s = after.at_s - before.at_s
    stats = deltas(before.stats, after.stats)

    def worker(name: str) -> float:
        return stats.get(f"{worker_id}:{name}", 0.0)

    num_steps = worker("num_steps")
    num_timed = stats.get("timing:num_steps", 0.0)
    if num_steps <= 0 or num_timed <= 0:
        raise RuntimeError("the worker ran no step in the window (is the load running?)")
    per_step_ms = {
        name.removesuffix("_s"): stats.get(f"timing:{name}", 0.0) * 1000 / num_timed
        for name in (*TURN_SEGMENTS, *STEP_SEGMENTS)
    }
    per_step_ms["publish"] = worker("commit_s") * 1000 / num_steps
    num_gaps = worker("num_step_gaps")
    per_step_ms["step_gap"] = worker("step_gap_s") * 1000 / num_gaps if num_gaps else 0.0
    commands = command_deltas(before.commands, after.commands)
    net = deltas(before.net_bytes, after.net_bytes)
    cores = {role: seconds / wall_s for role, seconds in deltas(before.cpu_s, after.cpu_s).items()}
    machine_cores = (after.machine_busy_s - before.machine_busy_s) / wall_s
    cores["other"] = max(0.0, machine_cores - sum(cores.values()))
    num_received = after.num_tokens_received - before.num_tokens_received
    return {
        "wall_s": wall_s,
        "num_steps": num_steps,
        "steps_per_s": num_steps / wall_s,
        "tokens_per_s": num_received / wall_s,
        "worker_tokens_per_s": worker("num_tokens") / wall_s,  # prompt tokens too
        "mean_batch": worker("num_requests") / num_steps,
        "turns_per_step": stats.get("timing:num_turns", 0.0) / num_timed,
        "per_step_ms": per_step_ms,
        "step_gap_p50_ms": gap_median_ms(stats, worker_id),
        "redis_per_step": {
            "commands": sum(c["calls"] for c in commands.values()) / num_steps,
            "bytes_in": net.get("total_net_input_bytes", 0.0) / num_steps,
            "bytes_out": net.get("total_net_output_bytes", 0.0) / num_steps,
            "usec": sum(c["usec"] for c in commands.values()) / num_steps,
            "by_command": {
                name: c["calls"] / num_steps
                for name, c in sorted(commands.items(), key=lambda item: -item[1]["calls"])
            },
        },
        "cpu_cores": cores,
    }


# --- CPU time of the processes ----------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def measure_engine_alone(
    model_dir: Path, workload: Workload, args: argparse.Namespace, when: str
) -> Row:
    """One engine-alone window on a quiet machine (measured again if disturbed)."""
    print(f"batch {workload.batch}: the engine alone ({when} the service)...", flush=True)
    for attempt in range(1 + args.retries):
        asyncio.run(wait_until_quiet(args.wait_quiet_s))
        alone = engine_alone_pinned(model_dir, workload, args)
        if not disturbed(f"batch {workload.batch}, engine alone", alone["other_cores"], attempt,
                         args):  # fmt: skip
            return alone
    return alone


def mean_row(first: Row, second: Row) -> Row:
    """Field by field mean of two engine-alone rows."""
    return {name: (first[name] + second[name]) / 2 for name in first}


def engine_alone_pinned(model_dir: Path, workload: Workload, args: argparse.Namespace) -> Row:
    """``engine_alone``, on the engine's CPU with --pin-engine (this process's own
    affinity is given back afterwards)."""
    if not args.cpu_split:
        return engine_alone(model_dir, workload, args.context, args.engine_s)
    own_cpus = frozenset(os.sched_getaffinity(0))
    pin_process(os.getpid(), args.cpu_split.engine)
    try:
        return engine_alone(model_dir, workload, args.context, args.engine_s)
    finally:
        pin_process(os.getpid(), own_cpus)


def _stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # after "pid (comm) "


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of one process so far."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def role_of(pid: int, root_pid: int) -> str | None:
    """Which part of the benchmark a process is, from its command line."""
    if pid == root_pid:
        return "load generator"
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    words = [word.decode(errors="replace") for word in argv]
    # redis-server rewrites its title: "/usr/bin/redis-server 127.0.0.1:PORT".
    if words and "redis-server" in words[0]:
        return "redis"
    # The worker's engine process (gpu_worker/engine_host.py), spawned by multiprocessing.
    if any("multiprocessing.spawn" in word for word in words):
        return "engine"
    modules = {"gpu_worker": "worker", "gateway": "gateway", "scheduler_actor": "scheduler",
               "orcapod": "launcher"}  # fmt: skip
    for flag, module in itertools.pairwise(words):
        if flag == "-m" and module in modules:
            return modules[module]
    return None


def descendants(root_pid: int) -> set[int]:
    """``root_pid`` and every process under it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(entry.name)] = int(_stat_fields(int(entry.name))[1])
    ours = {root_pid}
    grew = True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= found
        grew = bool(found)
    return ours


def roles_cpu_s(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system, every thread) of ``root_pid`` and its descendants, by role."""
    cpu = dict.fromkeys(ROLES, 0.0)
    for pid in descendants(root_pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            role = role_of(pid, root_pid)
            if role is not None:
                cpu[role] += process_cpu_s(pid)
    return cpu


@dataclass(frozen=True)
class CpuSplit:
    """Which CPUs the engine gets and which the rest of the benchmark (--pin-engine)."""

    engine: frozenset[int]
    rest: frozenset[int]

    @classmethod
    def of_this_machine(cls) -> CpuSplit:
        """The last CPU this process may use for the engine, the others for the rest."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin-engine needs at least 2 CPUs")
        return cls(engine=frozenset(cpus[-1:]), rest=frozenset(cpus[:-1]))


def pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Move every thread of ``pid`` to ``cpus`` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cpus)


def pin_service(root_pid: int, split: CpuSplit) -> dict[str, int]:
    """The engine process on the engine's CPU; this process and every other one
    under it on the rest. Returns how many processes of each role it moved."""
    moved = dict.fromkeys(ROLES, 0)
    for pid in descendants(root_pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            role = role_of(pid, root_pid)
            if role is not None:
                pin_process(pid, split.engine if role == "engine" else split.rest)
                moved[role] += 1
    return moved


def machine_busy_s() -> float:
    """CPU seconds every core spent busy since boot (/proc/stat; idle and iowait excluded)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


async def wait_until_quiet(max_wait_s: float, sample_s: float = 2.0) -> float:
    """Wait (at most ``max_wait_s``) until processes outside the benchmark use under
    ``BUSY_MACHINE_CORES``, on a machine shared with others; returns the wait."""
    started = time.monotonic()
    while time.monotonic() - started < max_wait_s:
        ours, busy = sum(roles_cpu_s(os.getpid()).values()), machine_busy_s()
        await asyncio.sleep(sample_s)
        ours_after, busy_after = sum(roles_cpu_s(os.getpid()).values()), machine_busy_s()
        if (busy_after - busy) - (ours_after - ours) < BUSY_MACHINE_CORES * sample_s:
            break
    return time.monotonic() - started


# --- the load ---------------------------------------------------------------------


@dataclass
class ClosedLoopLoad:
    """``num_clients`` clients over websockets, each sending its next request when its
    last one is done; token frames are counted, not decoded."""

    url: str
    workload: Workload
    num_clients: int
    num_tokens: int = 0
    num_done: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    failure: str | None = None
    _pending: dict[str, asyncio.Future[bool]] = field(default_factory=dict)  # True: an error
    _sockets: list[ClientConnection] = field(default_factory=list)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        """Until :meth:`stop` (and every request it cancels is done)."""
        num_sockets = -(-self.num_clients // REQUESTS_PER_SOCKET)
        for _ in range(num_sockets):
            # No compression: what the service does per frame, not zlib's work.
            self._sockets.append(
                await connect(self.url, compression=None, max_queue=None, open_timeout=30)
            )
        async with asyncio.TaskGroup() as tasks:
            for socket in self._sockets:
                tasks.create_task(self._read(socket))
            clients = [
                tasks.create_task(self._client(index, self._sockets[index % num_sockets]))
                for index in range(self.num_clients)
            ]
            await asyncio.wait(clients)
            for socket in self._sockets:
                await socket.close()

    async def stop(self) -> None:
        """Cancel what is in flight and let every client end."""
        self._stopping.set()
        for client_id in list(self._pending):
            with contextlib.suppress(ConnectionClosed):
                await self._socket_of(client_id).send(encode_json(Cancel(id=client_id)))
        deadline = time.monotonic() + STOP_WAIT_S
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._resolve_all()

    def _socket_of(self, client_id: str) -> ClientConnection:
        index = int(client_id[1:].split("-")[0])
        return self._sockets[index % len(self._sockets)]

    def _resolve_all(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_result(False)
        self._pending.clear()

    async def _client(self, index: int, socket: ClientConnection) -> None:
        rng = random.Random(index)
        max_tokens = self.workload.first_max_tokens(index % self.workload.batch)
        number = 0
        while not self._stopping.is_set():
            client_id = f"c{index}-{number}"
            number += 1
            future = asyncio.get_running_loop().create_future()
            self._pending[client_id] = future
            generate = Generate(
                id=client_id,
                prompt_token_ids=self.workload.prompt(rng),
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
            )
            try:
                await socket.send(encode_json(generate))
            except ConnectionClosed:
                self._fail("a socket closed")
                return
            if await future:
                await asyncio.sleep(0.1)  # refused (queue_full, say): not in a tight loop
            max_tokens = self.workload.max_tokens

    async def _read(self, socket: ClientConnection) -> None:
        try:
            async for frame in socket:
                if isinstance(frame, str) and frame.startswith(TOKEN_FRAME_PREFIX):
                    self.num_tokens += 1
                    continue
                message = decode_server_message(frame)
                if isinstance(message, Token):
                    self.num_tokens += 1
                    continue
                if isinstance(message, Done):
                    self.num_done += 1
                elif isinstance(message, Error):
                    self.errors[message.code] = self.errors.get(message.code, 0) + 1
                else:
                    continue
                future = self._pending.pop(message.id or "", None)
                if future is not None and not future.done():
                    future.set_result(isinstance(message, Error))
        except ConnectionClosed:
            pass
        if not self._stopping.is_set():
            self._fail("a socket closed")

    def _fail(self, reason: str) -> None:
        self.failure = self.failure or reason
        self._stopping.set()
        self._resolve_all()


# --- one run ----------------------------------------------------------------------

WORKER_ID = "worker-0"  # orcapod up's one worker


def snapshot(
    client: redis.Redis, stats_key: str, timing_key: str, load: ClosedLoopLoad
) -> Snapshot:
    """The workers' stats hash, the scheduler's step timing (as ``timing:*``),
    Redis's counters and every process's CPU time, now."""
    info_stats = client.info("stats")
    timing = {f"timing:{name}": v for name, v in stats_fields(client.hgetall(timing_key)).items()}
    return Snapshot(
        at_s=time.perf_counter(),
        stats=stats_fields(client.hgetall(stats_key)) | timing,
        commands=command_stats(client.info("commandstats")),
        net_bytes={name: float(info_stats[name]) for name in NET_BYTES},
        cpu_s=roles_cpu_s(os.getpid()),
        machine_busy_s=machine_busy_s(),
        num_tokens_received=load.num_tokens,
    )


async def drive_service(
    url: str, redis_url: str, workload: Workload, args: argparse.Namespace
) -> Row:
    """Load the service, measure one window after the warm-up, then cancel everything."""
    num_clients = workload.batch + max(2, workload.batch // 8)
    load = ClosedLoopLoad(url, workload, num_clients)
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys(DEFAULT_PREFIX)
    try:
        async with asyncio.TaskGroup() as tasks:
            pinned = pin_service(os.getpid(), args.cpu_split) if args.cpu_split else None
            tasks.create_task(load.run())
            await asyncio.sleep(args.warmup_s)
            for attempt in range(1 + args.retries):
                waited_s = await wait_until_quiet(args.wait_quiet_s)
                if args.cpu_split:  # again: threads started since (the load's, the engine's)
                    pinned = pin_service(os.getpid(), args.cpu_split)
                before = snapshot(client, keys.stats, keys.step_timing, load)
                await asyncio.sleep(args.duration_s)
                after = snapshot(client, keys.stats, keys.step_timing, load)
                row = service_row(before, after, WORKER_ID)
                if load.failure or not disturbed(
                    f"batch {workload.batch}, service", row["cpu_cores"]["other"], attempt, args
                ):
                    break  # fmt: skip
            await load.stop()
    finally:
        client.close()
    if load.failure is not None:
        raise RuntimeError(f"the load failed: {load.failure}")
    row["num_clients"] = num_clients
    row["pinned_processes"] = pinned
    row["waited_for_quiet_s"] = waited_s
    row["errors"] = load.errors
    return row


def disturbed(name: str, other_cores: float, attempt: int, args: argparse.Namespace) -> bool:
    """Whether a window was disturbed by other processes and will be measured again."""
    if other_cores <= BUSY_MACHINE_CORES or attempt >= args.retries:
        return False
    print(f"{name}: other processes used {other_cores:.2f} cores; measuring again", flush=True)
    return True


def up_args(model_dir: Path, batch: int, args: argparse.Namespace) -> list[str]:
    """``orcapod up`` flags: the tiny model on the CPU in the engine alone's
    exact float32 weights, the batch capped at ``batch``, gateways that cancel
    a closed socket's requests at once and stop quickly."""
    flags = [
        "--model", str(model_dir),
        "--worker-arg=--device=cpu", "--worker-arg=--dtype=float32",
        "--worker-arg=--weights=float32",
        f"--worker-arg=--kv-cache-bytes={KV_CACHE_BYTES}",
        f"--scheduler-arg=--max-batch-size={batch}",
        "--gateway-arg=--detach-grace-s=0", "--gateway-arg=--drain-timeout-s=5",
    ]  # fmt: skip
    if args.max_inflight is not None:
        flags.append(f"--worker-arg=--max-inflight={args.max_inflight}")
    return flags


def measure_batch(model_dir: Path, redis_url: str, batch: int, args: argparse.Namespace) -> Row:
    """The engine alone, then the service, at one batch size."""
    from orcapod.bench.service import orcapod_up

    vocab_size = int(TINY_LLAMA["vocab_size"])
    workload = Workload(batch, args.prompt_tokens, 2 * (args.context - args.prompt_tokens),
                        vocab_size)  # fmt: skip
    before = measure_engine_alone(model_dir, workload, args, "before")
    print(f"batch {batch}: the service...", flush=True)
    log_path = args.out.with_suffix("") / f"up-batch{batch}.log"
    # Read by torch at import: the worker's intra-op threads, as set_num_threads here.
    environment = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    flags = up_args(model_dir, batch, args)
    with orcapod_up(redis_url, "fair", log_path, flags, environment) as url:
        service = asyncio.run(drive_service(url, redis_url, workload, args))
    after = measure_engine_alone(model_dir, workload, args, "after")
    # The service's window between two of the engine's: a drift of the
    # machine's speed over the run (other guests of its host) evens out.
    alone = mean_row(before, after)
    return {
        "batch": batch,
        "prompt_tokens": workload.prompt_tokens,
        "max_tokens": workload.max_tokens,
        "engine_alone": alone,
        "engine_alone_before_after": [before, after],
        "service": service,
        "ratio": service["tokens_per_s"] / alone["tokens_per_s"],
    }


# --- the report -------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def render_tables(results: list[Row]) -> str:
    """The Markdown tables of a run: throughput, where a step's time goes, Redis, CPU."""
    throughput = [[
        str(r["batch"]), f"{r['engine_alone']['step_ms']:.2f}",
        f"{r['engine_alone']['tokens_per_s']:,.0f}", f"{r['service']['tokens_per_s']:,.0f}",
        f"{r['ratio']:.0%}", f"{r['service']['steps_per_s']:.0f}",
        f"{r['service']['mean_batch']:.1f}", f"{r['engine_alone']['decode_at_context_ms']:.2f}",
    ] for r in results]  # fmt: skip
    segments = ("turn", "turn_commit", "plan_transit", "plan_queued", "worker_host", "forward",
                "publish", "result_transit", "step_gap")  # fmt: skip
    breakdown = []
    for r in results:
        ms = r["service"]["per_step_ms"]
        cells = [f"{ms[name]:.2f}" for name in segments]
        p50 = r["service"]["step_gap_p50_ms"]
        cells[-1] += "" if p50 is None else f" (p50 ≤ {p50:g})"
        cells[5] += f" ({r['engine_alone']['forward_ms']:.2f})"
        breakdown.append([str(r["batch"]), *cells])
    redis_rows = []
    for r in results:
        per_step = r["service"]["redis_per_step"]
        top = ", ".join(f"{name} {calls:.1f}"
                        for name, calls in list(per_step["by_command"].items())[:6])  # fmt: skip
        redis_rows.append([str(r["batch"]), f"{per_step['commands']:.1f}",
                           f"{per_step['bytes_in']:,.0f}", f"{per_step['bytes_out']:,.0f}",
                           f"{per_step['usec']:.0f}", top])  # fmt: skip
    roles = (*ROLES, "other")
    cpu_rows = [[str(r["batch"]), f"{r['engine_alone']['cpu_cores']:.2f}",
                 *(f"{r['service']['cpu_cores'].get(role, 0.0):.2f}" for role in roles)]
                for r in results]  # fmt: skip
    lines = _table(["batch", "engine alone ms/step", "engine alone tok/s", "service tok/s",
                    "service / engine", "service steps/s", "service mean batch",
                    "decode at context ms"], throughput)  # fmt: skip
    lines += ["", "Per step, ms (forward: the service's, the engine alone's in brackets):", ""]
    lines += _table(["batch", "scheduler turn", "turn commit", "plan transit", "plan queued",
                     "worker host", "forward", "publish", "result transit", "step gap"],
                    breakdown)  # fmt: skip
    lines += ["", "Redis per worker step:", ""]
    lines += _table(["batch", "commands", "bytes in", "bytes out", "Redis µs", "by command"],
                    redis_rows)  # fmt: skip
    lines += ["", "CPU cores used: the engine alone's process; the service's, by process:", ""]
    lines += _table(["batch", "engine alone", *roles], cpu_rows)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: batch 8, 5-s windows")
    parser.add_argument("--batch", help="comma list of batch sizes (default 32,64; quick 8)")
    parser.add_argument("--duration-s", type=float, help="service window (default 30; quick 5)")
    parser.add_argument("--warmup-s", type=float, help="load before the window (default 5)")
    parser.add_argument("--engine-s", type=float, help="engine-alone window (default 10)")
    parser.add_argument("--context", type=int, help="mean attended context (default 256)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-inflight", type=int, help="passed to the worker")
    parser.add_argument("--wait-quiet-s", type=float, default=0.0,
                        help="on a shared machine: wait up to this long before each window "
                        "for other processes to leave the CPUs")  # fmt: skip
    parser.add_argument("--retries", type=int, default=0,
                        help="measure a window again (this many times at most) when other "
                        "processes used the CPUs during it")  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch threads, here and in the worker")
    parser.add_argument("--pin-engine", action="store_true",
                        help="one CPU for the engine alone, the others for the rest, "
                        "as a GPU would be (with --threads 1)")  # fmt: skip
    parser.add_argument("--cache-dir", help="where the tiny model is written (default: orcapod's)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "control_plane.json")
    args = parser.parse_args(argv)
    quick = args.quick
    args.batches = [int(b) for b in (args.batch or ("8" if quick else "32,64")).split(",")]
    args.duration_s = args.duration_s or (5.0 if quick else 30.0)
    args.warmup_s = args.warmup_s or (2.0 if quick else 5.0)
    args.engine_s = args.engine_s or (2.0 if quick else 10.0)
    args.context = args.context or (64 if quick else 256)
    if args.context <= args.prompt_tokens:
        parser.error("--context must exceed --prompt-tokens")
    args.cpu_split = CpuSplit.of_this_machine() if args.pin_engine else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from orcapod.bench.service import benchmark_redis

    if args.threads:
        torch.set_num_threads(args.threads)

    cache_dir = model_location(cache_dir=args.cache_dir).cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(cache_dir, tokenizer_source(cache_dir))
    results = []
    with benchmark_redis() as embedded:
        for batch in args.batches:
            results.append(measure_batch(model_dir, embedded.url, batch, args))
    result = {
        "machine": torch_machine() | {"load_average": os.getloadavg()},
        "model": TINY_LLAMA,
        "settings": {
            name: getattr(args, name)
            for name in (
                "context",
                "prompt_tokens",
                "duration_s",
                "warmup_s",
                "engine_s",
                "max_inflight",
                "threads",
                "pin_engine",
                "wait_quiet_s",
                "retries",
            )
        },
        "results": results,
    }
    print(render_tables(results))
    for row in results:
        for name, other in (("engine alone", row["engine_alone"]["other_cores"]),
                            ("service", row["service"]["cpu_cores"]["other"])):  # fmt: skip
            if other > BUSY_MACHINE_CORES:
                print(
                    f"warning: batch {row['batch']}, {name}: other processes used "
                    f"{other:.2f} cores during the window; its numbers are disturbed"
                )
    write_json(args.out, result)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
