"""``python -m gpu_worker``: load the model, size the K/V cache, serve plans until SIGTERM."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from gpu_worker.actor import WorkerActor
from gpu_worker.engine_host import (
    EngineHost,
    EngineProcess,
    EngineStartFailed,
    EngineThread,
    build_engine,
)
from shared.log import configure_logging, run_actor, stop_on_signals
from shared.metrics_http import run_with_metrics
from shared.redis_streams import connect
from shared.settings import (
    DEFAULT_KV_CACHE_FRACTIONS,
    MAX_INFLIGHT,
    WEIGHT_FORMATS,
    WorkerSettings,
    add_redis_arguments,
    default_instance_id,
    env_bool,
    flag_environment_default,
    int_flag,
    kv_cache_fraction_flag,
    model_location,
    redis_settings_from_args,
)

# One source of defaults: the settings dataclass.
DEFAULTS = {field.name: field.default for field in dataclasses.fields(WorkerSettings)}


def build_parser() -> argparse.ArgumentParser:
    """The worker's flags, their defaults from the environment (shared.settings)."""
    parser = argparse.ArgumentParser(prog="python -m gpu_worker", description=__doc__)
    add_redis_arguments(parser)
    parser.add_argument("--worker-id", help="default: worker-<host>-<pid>")
    parser.add_argument("--model", help="HF-format model dir (default: $ORCAPOD_MODEL or SmolLM2)")
    parser.add_argument("--cache-dir", help="prepared models (default: $ORCAPOD_CACHE_DIR)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 (default: CUDA when present)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="the model's dtype (default: bfloat16 on CUDA, float32 on the CPU, where "
        "--weights packs the matrices)",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=flag_environment_default("weights", DEFAULTS["weight_format"], str),
        help="float32: exact; q4_1: matrices on llama.cpp's Q4_1 grid (the packaged "
        "model's layers) kept as they are for orcapod's C++ kernel, fp32 arithmetic "
        "(CPUs with AVX2, FMA and F16C); float16: matrices packed for fbgemm; int4: Q4_1 "
        "matrices in torch's 4-bit kernel, bf16 arithmetic (CPUs with avx512_bf16; a greedy "
        "answer can change with the batch it runs in); fewer bytes per token (CPU and "
        "--dtype float32 only; where one cannot run or hold a matrix, or its logits of a "
        "probe prompt stray, the next or the loaded weights, with a log line); auto "
        "(default): q4_1 on the CPU where the layers are on its grid and its kernel runs, "
        "else float16; the loaded weights elsewhere ($ORCAPOD_WEIGHTS)",
    )
    parser.add_argument("--backend", help="attention backend (default: the device's fastest)")
    parser.add_argument(
        "--kv-cache-bytes",
        type=int_flag(1),
        help="K/V pool size in bytes, as asked (default: sized from memory as below; "
        "a pool below one sequence of the model's context serves only shorter requests)",
    )
    parser.add_argument(
        "--kv-cache-fraction",
        type=kv_cache_fraction_flag,
        default=DEFAULTS["kv_cache_fraction"],
        help="share of the memory available once the model is loaded (the host's "
        "MemAvailable, or the GPU's free memory) that the K/V pool may take, above 0 "
        f"and below 1 (default: {DEFAULT_KV_CACHE_FRACTIONS['cpu']} on the CPU, "
        f"{DEFAULT_KV_CACHE_FRACTIONS['cuda']} on CUDA); never more than "
        "--kv-cache-max-sequences sequences of the model's full context, never less "
        "than one (else the worker stops at start and says what to change)",
    )
    parser.add_argument(
        "--kv-cache-max-sequences",
        type=int_flag(1),
        default=DEFAULTS["kv_cache_max_sequences"],
        help="full-context sequences the K/V pool is sized for at most: the scheduler's "
        "--max-batch-size, which bounds the requests placed on one worker (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=int_flag(1),
        default=DEFAULTS["block_size"],
        help="tokens per K/V block; the worker announces it when it joins and the scheduler "
        "counts blocks with it",
    )
    parser.add_argument(
        "--max-inflight",
        type=int_flag(1, MAX_INFLIGHT),
        default=DEFAULTS["max_inflight"],
        help=f"plans held at once, the worker's lookahead (1 to {MAX_INFLIGHT})",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=DEFAULTS["heartbeat_s"],
        help="how often the worker refreshes its heartbeat key (which lives 3 beats, at least "
        "1 s); the scheduler's --worker-timeout-s counts from the key's expiry",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay captured CUDA graphs for decode-only steps (CUDA only; ignored on the CPU)",
    )
    parser.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=flag_environment_default("compile_decode", DEFAULTS["compile_decode"], env_bool),
        help="on the CPU, run a lone request's decode steps through one graph compiled at "
        "start, and other steps' decodes through a compiled attention that reads the K/V "
        "pool in place (torch.compile; tens of seconds the first time, cached in "
        "$TORCHINDUCTOR_CACHE_DIR, default the cache dir's inductor/; where it cannot, "
        "the eager forward, with a log line) ($ORCAPOD_COMPILE_DECODE: 1 or 0)",
    )
    parser.add_argument(
        "--serve-while-compiling",
        action=argparse.BooleanOptionalAction,
        default=flag_environment_default(
            "serve_while_compiling", DEFAULTS["serve_while_compiling"], env_bool
        ),
        help="with --compile-decode, serve at once on the eager forward while the compiled "
        "paths are built, each taking the steps from the one after it passed its checks "
        "(a step_path_live line); --no-serve-while-compiling builds them before serving "
        "($ORCAPOD_SERVE_WHILE_COMPILING: 1 or 0)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULTS["metrics_port"],
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; "
        "default: not served)",
    )
    parser.add_argument(
        "--metrics-host", default=DEFAULTS["metrics_host"], help="address of the metrics server"
    )
    parser.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine on a thread of this process, not in a process of its own "
        "(which keeps its Python from waiting on the Redis loop's GIL)",
    )
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> WorkerSettings:
    """Settings from flags, falling back to the environment (shared.settings)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.weights not in WEIGHT_FORMATS:  # argparse checks choices only when given
        parser.error(
            f"$ORCAPOD_WEIGHTS: {args.weights!r} is not one of {', '.join(WEIGHT_FORMATS)}"
        )
    return WorkerSettings(
        redis=redis_settings_from_args(args),
        model=model_location(model_dir=args.model, cache_dir=args.cache_dir),
        worker_id=args.worker_id or default_instance_id("worker"),
        device=args.device,
        dtype=args.dtype,
        weight_format=args.weights,
        attention_backend=args.backend,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_cache_fraction=args.kv_cache_fraction,
        block_size=args.block_size,
        kv_cache_max_sequences=args.kv_cache_max_sequences,
        max_inflight=args.max_inflight,
        heartbeat_s=args.heartbeat_s,
        cuda_graphs=args.cuda_graphs,
        compile_decode=args.compile_decode,
        serve_while_compiling=args.serve_while_compiling,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        engine_process=not args.engine_thread,
    )


async def serve(settings: WorkerSettings, host: EngineHost) -> None:
    """Run the actor (and its metrics server, when asked) until a signal asks it to stop."""
    stop = stop_on_signals()
    redis = connect(settings.redis.url)
    actor = WorkerActor(settings, redis, host)
    try:
        await run_with_metrics(
            actor.run(stop), actor.metrics.registry, settings.metrics_host, settings.metrics_port
        )
    finally:
        await redis.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit status 0 after a clean shutdown."""
    settings = parse_settings(argv)
    log = configure_logging("worker")
    log.info("loading_model", model_dir=str(settings.model.model_dir), worker_id=settings.worker_id)
    host: EngineHost
    failed: BaseException | None = None
    try:
        if settings.engine_process:
            host = EngineProcess(settings)  # loads the model in the child, at start
        else:
            host = EngineThread(build_engine(settings), settings.worker_id)
        return run_actor("python -m gpu_worker", serve(settings, host), settings.redis)
    except* EngineStartFailed as group:  # the engine logged why; no traceback here
        failed = group.exceptions[0]
    print(f"python -m gpu_worker: {failed}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
