"""``python -m gpu_worker``: load the model, size the K/V cache, serve plans until SIGTERM."""

from __future__ import annotations

import argparse
import dataclasses
import os
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
from gpu_worker.pipeline_layout import (
    GroupConfigError,
    parse_layer_split,
    rendezvous_address,
    world_size,
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
    positive_float,
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
        "(CPUs with AVX2, FMA and F16C); q4_1_i16: the same matrices times activations "
        "rounded to int16 per 32 values, in integers (a lone chat about 1.3x q4_1's "
        "speed; logits within 0.2 %% of fp32's; a greedy answer can change with the "
        "batch it runs in); "
        "float16: matrices packed for fbgemm; int4: Q4_1 "
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
        help=f"plans held at once, the worker's lookahead (1 to {MAX_INFLIGHT}; default: "
        f"{DEFAULTS['max_inflight']}, or with --pipeline-parallel P one plan per stage and one "
        "more on its way, P + 1, each a batch of its own; 1 feeds a group one plan at a time)",
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
    group = parser.add_argument_group(
        "worker group",
        "one model split into pipeline stages, one engine rank each, over torch.distributed "
        "(gloo); rank 0 is the group's only Redis client, and to the scheduler the group is "
        "one worker",
    )
    group.add_argument(
        "--pipeline-parallel",
        type=int_flag(1),
        # A string default goes through ``type`` (argparse), so a bad $ORCAPOD_… is a usage error.
        default=flag_environment_default("pipeline_parallel", DEFAULTS["pipeline_parallel"], str),
        help="pipeline stages, each running a run of consecutive layers (default: %(default)s: "
        "the whole model in one engine; at most the model's layers) ($ORCAPOD_PIPELINE_PARALLEL)",
    )
    group.add_argument(
        "--tensor-parallel",
        type=int_flag(1),
        default=flag_environment_default("tensor_parallel", DEFAULTS["tensor_parallel"], str),
        help="engine ranks of each stage, its layers' attention heads, K/V heads and MLP "
        "split between them, one all-reduce after each row-parallel product (default: "
        "%(default)s; must divide the model's heads, K/V heads and intermediate size) "
        "($ORCAPOD_TENSOR_PARALLEL)",
    )
    group.add_argument(
        "--layer-split",
        type=_layer_split_flag,
        help="layers of each stage, like 16,14 (default: balanced by count)",
    )
    group.add_argument(
        "--group-rank",
        type=int_flag(0),
        default=_environment_int("RANK"),
        help="run only this rank of the group (rank 0 talks to Redis; ranks 1 on need no "
        "Redis) and meet the others at --rendezvous; default: every rank on this host "
        "($RANK)",
    )
    group.add_argument(
        "--rendezvous",
        default=_rendezvous_from_environment(),
        help="HOST:PORT where the ranks meet (rank 0 listens there; default with every rank "
        "on this host: a free port on 127.0.0.1; else $MASTER_ADDR:$MASTER_PORT)",
    )
    group.add_argument(
        "--rendezvous-timeout-s",
        type=positive_float,
        default=DEFAULTS["rendezvous_timeout_s"],
        help="how long the ranks wait for each other at start (and rank 0 for the missing "
        "ones, which it then names) (default: %(default)s)",
    )
    group.add_argument(
        "--local-ranks",
        type=int_flag(1),
        default=_environment_int("LOCAL_WORLD_SIZE"),
        help="ranks of the group on this host, which share its memory and cores (default: "
        "every rank, or 1 with --group-rank) ($LOCAL_WORLD_SIZE)",
    )
    parser.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine on a thread of this process, not in a process of its own "
        "(which keeps its Python from waiting on the Redis loop's GIL)",
    )
    return parser


def _max_inflight(flag: int | None, pipeline_parallel: int) -> int:
    """The flag, else for a group one plan per stage and one more on its way (at most
    MAX_INFLIGHT), else the default. The one more hides the control plane's round
    trip (a result out, the scheduler's turn, the next plan in) behind a stage's
    step: 1.26 against 1.12 req/s for two stages on the Orca trace
    (docs/performance.md, *Worker groups*)."""
    if flag is not None:
        return flag
    if pipeline_parallel > 1:
        return min(pipeline_parallel + 1, MAX_INFLIGHT)
    return WorkerSettings.max_inflight


def _layer_split_flag(text: str) -> tuple[int, ...]:
    try:
        return parse_layer_split(text)
    except GroupConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _environment_int(name: str) -> int | None:
    """An integer variable of torch.distributed's launchers, if set and one."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def _rendezvous_from_environment() -> str | None:
    """``$MASTER_ADDR:$MASTER_PORT``, as torch.distributed's launchers set them."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{address}:{port}" if address and port else None


def parse_settings(argv: Sequence[str] | None = None) -> WorkerSettings:
    """Settings from flags, falling back to the environment (shared.settings)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.weights not in WEIGHT_FORMATS:  # argparse checks choices only when given
        parser.error(
            f"$ORCAPOD_WEIGHTS: {args.weights!r} is not one of {', '.join(WEIGHT_FORMATS)}"
        )
    for flag, value in (("--pipeline-parallel", args.pipeline_parallel),
                        ("--tensor-parallel", args.tensor_parallel)):  # fmt: skip
        if value < 1:  # from the environment, unchecked by argparse
            parser.error(f"{flag} must be at least 1, got {value}")
    num_ranks = args.pipeline_parallel * args.tensor_parallel
    if num_ranks > 1 and args.engine_thread:
        parser.error("a worker group (--pipeline-parallel or --tensor-parallel above 1) runs "
                     "its engines in processes")  # fmt: skip
    if args.layer_split is not None and len(args.layer_split) != args.pipeline_parallel:
        parser.error(
            f"--layer-split names {len(args.layer_split)} stages but --pipeline-parallel "
            f"is {args.pipeline_parallel}"
        )
    if args.group_rank is not None and num_ranks > 1:
        if args.group_rank >= num_ranks:
            parser.error(
                f"--group-rank {args.group_rank} is outside the group's ranks 0 to {num_ranks - 1}"
            )
        if args.rendezvous is None:
            parser.error(
                "--group-rank needs --rendezvous HOST:PORT (or $MASTER_ADDR and $MASTER_PORT)"
            )
    if args.rendezvous is not None:
        try:
            rendezvous_address(args.rendezvous)
        except GroupConfigError as error:
            parser.error(str(error))
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
        max_inflight=_max_inflight(args.max_inflight, args.pipeline_parallel),
        heartbeat_s=args.heartbeat_s,
        cuda_graphs=args.cuda_graphs,
        compile_decode=args.compile_decode,
        serve_while_compiling=args.serve_while_compiling,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        engine_process=not args.engine_thread,
        pipeline_parallel=args.pipeline_parallel,
        tensor_parallel=args.tensor_parallel,
        layer_split=args.layer_split,
        group_rank=args.group_rank,
        rendezvous=args.rendezvous,
        rendezvous_timeout_s=args.rendezvous_timeout_s,
        local_ranks=args.local_ranks,
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
    if world_size(settings) > 1 and settings.group_rank not in (None, 0):
        # A stage behind the first, on a host of its own: no Redis, no shell.
        from gpu_worker.pipeline_stage_loop import stage_process_main

        return stage_process_main(settings, settings.group_rank, spawned=False)
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
