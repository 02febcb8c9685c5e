"""``python -m scheduler_actor``: run the one scheduler until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from scheduler_actor.actor import SchedulerActor
from shared.log import configure_logging, run_actor, stop_on_signals
from shared.metrics_http import run_with_metrics
from shared.redis_streams import connect
from shared.settings import (
    POLICIES,
    SchedulerSettings,
    add_redis_arguments,
    int_flag,
    model_location,
    redis_settings,
    redis_settings_from_args,
    served_model_name,
)


def build_parser() -> argparse.ArgumentParser:
    """The scheduler's command line (``docs/configuration.md`` is made from it)."""
    defaults = SchedulerSettings(redis=redis_settings())
    parser = argparse.ArgumentParser(prog="python -m scheduler_actor", description=__doc__)
    add_redis_arguments(parser)
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default=defaults.policy,
        help="how requests are batched: fair (iteration-level, chunked prefill, fairness "
        "between tenants), orca (the paper's Algorithm 1), request (static batches); "
        "docs/scheduler.md",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int_flag(1),
        default=defaults.max_batch_size,
        help="requests in one plan; under fair and request also the requests placed on one "
        "worker (a worker's --kv-cache-max-sequences should match it)",
    )
    parser.add_argument(
        "--token-budget",
        type=int_flag(1),
        default=defaults.token_budget,
        help="new tokens (decodes and prompt chunks) of one step under fair",
    )
    parser.add_argument(
        "--max-chunk-tokens",
        type=int_flag(1),
        default=defaults.max_chunk_tokens,
        help="the largest piece of one prompt prefilled in one step under fair",
    )
    parser.add_argument(
        "--pipeline-token-budget",
        type=int_flag(1),
        default=defaults.pipeline_token_budget,
        help="new tokens of one step, and the largest prompt chunk, on a worker group of "
        "several pipeline stages under fair (its stages stay busy when its plans are alike)",
    )
    parser.add_argument(
        "--worker-timeout-s",
        type=float,
        default=defaults.worker_timeout_s,
        help="a worker whose heartbeat key has been gone this long is lost: its requests "
        "wait again and are recomputed on another worker",
    )
    parser.add_argument(
        "--orphan-timeout-s",
        type=float,
        default=defaults.orphan_timeout_s,
        help="cancel the requests of a gateway silent this long (unless resumed elsewhere)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=defaults.max_waiting,
        help="requests waiting for a worker, all tenants together; more get queue_full",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=defaults.metrics_port,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; "
        "default: not served)",
    )
    parser.add_argument(
        "--metrics-host", default=defaults.metrics_host, help="address of the metrics server"
    )
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=defaults.prefix_caching,
        help="keep the K/V of full prompt blocks and start prefills after a cached prefix",
    )
    parser.add_argument(
        "--cache-routing",
        action=argparse.BooleanOptionalAction,
        default=defaults.cache_aware_routing,
        help="send a request to the worker caching its longest prefix (else: most free K/V)",
    )
    parser.add_argument(
        "--routing-slack",
        type=int_flag(0),
        default=defaults.routing_slack,
        help="a worker caching the prefix is passed over when it runs more than this many "
        "requests beyond the least loaded",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the HF-format model dir the workers serve (default: $ORCAPOD_MODEL, else the "
        "embedded one); only its name is used, as the model_name label of the metrics",
    )
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> SchedulerSettings:
    """Settings from flags, falling back to the environment (shared.settings)."""
    args = build_parser().parse_args(argv)
    return SchedulerSettings(
        redis=redis_settings_from_args(args),
        policy=args.policy,
        max_batch_size=args.max_batch_size,
        token_budget=args.token_budget,
        max_chunk_tokens=args.max_chunk_tokens,
        pipeline_token_budget=args.pipeline_token_budget,
        worker_timeout_s=args.worker_timeout_s,
        orphan_timeout_s=args.orphan_timeout_s,
        max_waiting=args.max_waiting,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        prefix_caching=args.prefix_cache,
        cache_aware_routing=args.cache_routing,
        routing_slack=args.routing_slack,
        model_name=served_model_name(model_location(model_dir=args.model).model_dir),
    )


async def serve(settings: SchedulerSettings) -> None:
    """Run the actor (and its metrics server, when asked) until a signal asks it to stop."""
    stop = stop_on_signals()
    redis = connect(settings.redis.url)
    actor = SchedulerActor(settings, redis)
    try:
        await run_with_metrics(
            actor.run(stop), actor.metrics.registry, settings.metrics_host, settings.metrics_port
        )
    finally:
        await redis.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit status 0 after a clean shutdown."""
    settings = parse_settings(argv)
    configure_logging("scheduler")
    return run_actor("python -m scheduler_actor", serve(settings), settings.redis)


if __name__ == "__main__":
    sys.exit(main())
