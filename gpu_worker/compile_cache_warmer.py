"""The compiled paths' first compile, in a process of its own.

The engine builds its compiled paths on a thread while it serves
(``path_compiler.py``), but a compile from scratch holds the interpreter's
lock for long stretches (dynamo's tracing, inductor's code generation, the
imports they pull in): measured on SmolLM2 on two cores, an eager decode
step took 0.4-0.6 s instead of 16 ms for the whole minute of an empty
cache's compile, whatever the switch interval or the OpenMP threads. So the
first compile runs here, in a child process with the same model, weight
format and pool shape, and only fills inductor's cache
(``TORCHINDUCTOR_CACHE_DIR``, inherited); the engine's thread waits for it
without the lock, then compiles from the cache in a few seconds.

A marker per (model, format, pool shape, torch, ISA) in the cache folder
says a warm-up passed, so a restart skips the child; a child that fails or
times out only costs the time (the engine then compiles itself, as before).

    python -m gpu_worker.compile_cache_warmer --model DIR --dtype float32 \\
        --weights float16 --backend cpu --block-size 16 --num-blocks 3072
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from shared.parent_death import die_with_parent

_log = structlog.get_logger(__name__)

# Longer than any first compile seen (int4's batch graphs: about three minutes on
# two cores); past it the engine compiles itself.
WARM_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class WarmerSpec:
    """What the child must load to compile the engine's graphs: the same model, as the
    engine packed it, with the same attention backend."""

    model_dir: Path
    dtype: str
    weight_format: str
    attention_backend: str

    def argv(self, num_blocks: int, block_size: int) -> list[str]:
        """The child's command line for a pool of this shape."""
        return [
            sys.executable, "-m", "gpu_worker.compile_cache_warmer",
            "--model", str(self.model_dir), "--dtype", self.dtype,
            "--weights", self.weight_format, "--backend", self.attention_backend,
            "--block-size", str(block_size), "--num-blocks", str(num_blocks),
        ]  # fmt: skip

    def marker(self, num_blocks: int, block_size: int) -> Path | None:
        """The file that says these graphs are in the cache (None: no cache folder set)."""
        cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if not cache_dir:
            return None
        import torch

        key = "\n".join(
            [*self.argv(num_blocks, block_size)[3:], torch.__version__,
             os.environ.get("ATEN_CPU_CAPABILITY", "")]
        )  # fmt: skip
        return Path(cache_dir) / "orcapod-warmed" / hashlib.sha256(key.encode()).hexdigest()


def warm_compile_cache(spec: WarmerSpec, num_blocks: int, block_size: int) -> None:
    """Fill inductor's cache for a pool of this shape in a child process, unless a
    marker says it was done; blocks until then (the caller's thread waits without
    the interpreter's lock). Never raises: a failure is one log line."""
    marker = spec.marker(num_blocks, block_size)
    if marker is not None and marker.exists():
        return
    started = time.perf_counter()
    _log.info("compile_cache_warming", note="the first compile, in a process of its own")
    try:
        child = subprocess.run(
            spec.argv(num_blocks, block_size),
            capture_output=True,  # its lines would read as the engine's own
            timeout=WARM_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        _log.warning("compile_cache_not_warmed", reason=f"over {WARM_TIMEOUT_S:.0f} s")
        return
    if child.returncode != 0:
        tail = child.stderr.decode(errors="replace")[-2000:]
        _log.warning("compile_cache_not_warmed", exit_status=child.returncode, output=tail)
        return
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    _log.info("compile_cache_warmed", seconds=round(time.perf_counter() - started, 1))


def main(argv: list[str] | None = None) -> int:
    """Compile (and check) the engine's paths for one pool shape; 0 once done."""
    die_with_parent()  # the engine that started us, whatever kills it
    # The engine's steps come first: its OpenMP threads wait at every barrier for
    # the slowest, which a compile beside them at the same priority keeps off a
    # core; at nice 10 the compile takes about a tenth of the CPU while steps run
    # back to back, all of it while the engine idles.
    os.nice(10)
    parser = argparse.ArgumentParser(prog="python -m gpu_worker.compile_cache_warmer")
    parser.add_argument("--model", required=True, help="the model directory")
    parser.add_argument("--dtype", required=True, help="the model's dtype")
    parser.add_argument("--weights", required=True, help="the weight format the engine packed")
    parser.add_argument("--backend", required=True, help="the engine's attention backend")
    parser.add_argument("--block-size", type=int, required=True, help="tokens per K/V block")
    parser.add_argument("--num-blocks", type=int, required=True, help="blocks in the pool")
    args = parser.parse_args(argv)
    from gpu_worker.engine import Engine
    from gpu_worker.kv_cache import KVCacheBudget, bytes_per_block
    from gpu_worker.model_loading import load_model
    from shared.log import configure_logging

    configure_logging("worker")
    model = load_model(Path(args.model), "cpu", args.dtype, args.weights)
    pool_bytes = args.num_blocks * bytes_per_block(model.config, args.block_size, model.dtype)
    budget = KVCacheBudget(num_bytes=pool_bytes, block_size=args.block_size)
    Engine(model, budget, args.backend, compile_decode=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
