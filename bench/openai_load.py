"""An independent load tool (NVIDIA's AIPerf) and ``orcapod bench`` on the same load, one table.

    python -m bench.openai_load [--url http://127.0.0.1:PORT] [--api-key KEY]
                                [--peer-url http://127.0.0.1:PORT2 | --llama-server]
                                [--rate 0.3] [--duration 60] [--prompt-tokens 128]
                                [--output-tokens 64] [--endpoint completions|chat]
                                [--out bench/results/openai_load.json]

One at a time, against the service at ``--url`` (without it: an ``orcapod up``
of its own on a private redis-server, per-tenant caps lifted as in
``orcapod bench compare``):

1. AIPerf over the OpenAI API: ``aiperf profile --endpoint-type completions
   --streaming``, synthetic prompts of ``--prompt-tokens`` tokens drawn at
   random from the local tokenizer's vocabulary (``--prompt-corpus random``),
   ``max_tokens`` = ``--output-tokens`` with ``ignore_eos``, Poisson arrivals
   at ``--rate`` for ``--duration`` s, then up to ``--grace`` s for answers;
   token counts from the server's ``usage`` (``--use-server-token-count``:
   re-tokenizing the streamed text of random tokens undercounts by a few).
2. ``orcapod bench`` over the websocket protocol, the same load: the
   ``homogeneous`` trace (``--prompt-len``, ``--max-tokens``, ``ignore_eos``),
   Poisson arrivals at the same rate for the same duration, ``--drain-timeout``
   = ``--grace``. The two tools draw their own arrival times and prompts.
3. With ``--peer-url`` (or ``--llama-server``, which starts the llama.cpp
   ``llama-server`` that ``bench/llama_cpp.py`` built, on the packaged GGUF,
   only for its run, one thread by default): AIPerf alone against that
   server, the same load, after orcapod (when it is this script's) stopped.

Why AIPerf: of the three tools the issue names it is the one that installs
from PyPI without torch (``pip install --dry-run`` of guidellm 0.8.1 pulls
torch and its CUDA wheels; ``vllm bench serve`` needs all of vLLM). It lives
in its own venv, ``--tool-venv`` (made here on first use: ``python -m venv``,
then ``pip install aiperf==0.13.0``, about 2 minutes, 1.2 GB, no torch).

Offline: ``--tokenizer`` is the local HF-format model dir. AIPerf 0.13.0
cannot load a local dir under ``HF_HUB_OFFLINE=1`` (its offline branch hands
the path to ``snapshot_download``, which rejects it as a repo id), so the
tool runs with ``HF_HUB_OFFLINE`` unset and ``HF_ENDPOINT`` on a closed
loopback port: a local dir never asks the hub, and any look-up that would
fails at once on this machine.

Prints one markdown table (per tool and target: requests/s, output tokens/s,
TTFT, ITL per token gap, TPOT per request, end-to-end latency) and writes
JSON with the machine, the load, every command and the tools' summaries.
Never run by the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.child_process import REPO_ROOT
from bench.llama_server import add_llama_arguments, llama_server
from bench.machine import loadavg_1m, lscpu_machine
from bench.output import RESULTS_DIR, log, write_json

AIPERF_VERSION = "0.13.0"
DEFAULT_VENV = Path.home() / ".cache" / "orcapod" / "loadtool-venv"
DEFAULT_TOKENIZER = Path.home() / ".cache" / "orcapod" / "models" / "SmolLM2-135M-Instruct"
CLOSED_HUB = "http://127.0.0.1:9"  # discard port: nothing listens, a look-up fails at once
SETTLE_S = 5.0  # between runs, so the previous run's work has left the engine
LLAMA_SLOTS, LLAMA_CONTEXT = 8, 8192  # 1,024 tokens per slot


@dataclass(frozen=True)
class Load:
    """The load both tools send: fixed lengths, Poisson arrivals, bounded in time."""

    prompt_tokens: int = 128
    output_tokens: int = 64
    rate_rps: float = 0.3
    duration_s: float = 60.0
    grace_s: float = 120.0
    seed: int = 0


@dataclass(frozen=True)
class Percentiles:
    p50: float | None
    p99: float | None


@dataclass(frozen=True)
class Summary:
    """One run as a client saw it; times in seconds."""

    tool: str
    target: str
    num_completed: int
    num_errors: int
    requests_per_s: float
    output_tokens_per_s: float
    mean_output_tokens: float | None
    cached_prompt_pct: float | None  # prompt tokens the server says it took from its cache
    ttft_s: Percentiles
    itl_s: Percentiles  # every gap between two streamed tokens (chunks), all requests pooled
    tpot_s: Percentiles | None  # per request: (e2e - TTFT) / (output tokens - 1)
    e2e_s: Percentiles | None


# --- the tools' command lines and result files (pure) ---------------------------------


def aiperf_command(
    aiperf: Path,
    url: str,
    model: str,
    load: Load,
    tokenizer: Path,
    artifact_dir: Path,
    endpoint: str = "completions",
    api_key: str | None = None,
) -> list[str]:
    """``aiperf profile`` for ``load`` against ``url`` (an OpenAI-compatible server)."""
    command = [
        str(aiperf), "profile", "--url", url, "--model", model,
        "--endpoint-type", endpoint, "--streaming",
        "--tokenizer", str(tokenizer), "--prompt-corpus", "random",
        "--isl", str(load.prompt_tokens), "--osl", str(load.output_tokens),
        "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
        "--request-rate", str(load.rate_rps), "--arrival-pattern", "poisson",
        "--benchmark-duration", str(load.duration_s),
        "--benchmark-grace-period", str(load.grace_s),
        "--random-seed", str(load.seed),
        # 2 cores: one worker and one record processor are plenty at a few req/s.
        "--workers-max", "1", "--record-processors", "1",
        "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
        "--artifact-dir", str(artifact_dir),
    ]  # fmt: skip
    if api_key:
        command += ["--api-key", api_key]
    return command


def orcapod_bench_command(ws_url: str, load: Load, out: Path, api_key: str | None) -> list[str]:
    """``orcapod bench`` sending the same load over the websocket protocol."""
    command = [
        sys.executable, "-m", "orcapod", "bench", "--url", ws_url,
        "--trace", "homogeneous", "--prompt-len", str(load.prompt_tokens),
        "--max-tokens", str(load.output_tokens), "--rates", str(load.rate_rps),
        "--duration", str(load.duration_s), "--drain-timeout", str(load.grace_s),
        "--seed", str(load.seed), "--no-progress", "--out", str(out),
    ]  # fmt: skip
    if api_key:
        command += ["--api-key", api_key]
    return command


def _aiperf_percentiles(document: dict[str, Any], name: str) -> Percentiles | None:
    metric = document.get(name)
    if not metric or metric.get("p50") is None:
        return None
    assert metric["unit"] == "ms", f"{name} is in {metric['unit']}"
    return Percentiles(metric["p50"] / 1000, metric["p99"] / 1000)


def _aiperf_value(document: dict[str, Any], name: str) -> float | None:
    metric = document.get(name)
    return None if metric is None else metric.get("avg")


def parse_aiperf(document: dict[str, Any], target: str) -> Summary:
    """A Summary of AIPerf's ``profile_export_aiperf.json``."""
    num_errors = _aiperf_value(document, "error_request_count")
    if num_errors is None:
        num_errors = sum(entry.get("count", 0) for entry in document.get("error_summary") or [])
    none = Percentiles(None, None)
    return Summary(
        tool=f"aiperf {document.get('aiperf_version', '')}".strip(),
        target=target,
        num_completed=int(_aiperf_value(document, "request_count") or 0),
        num_errors=int(num_errors),
        requests_per_s=_aiperf_value(document, "request_throughput") or 0.0,
        output_tokens_per_s=_aiperf_value(document, "output_token_throughput") or 0.0,
        mean_output_tokens=_aiperf_value(document, "output_sequence_length"),
        cached_prompt_pct=_aiperf_value(document, "overall_usage_prompt_cache_read_pct"),
        ttft_s=_aiperf_percentiles(document, "time_to_first_token") or none,
        itl_s=_aiperf_percentiles(document, "inter_chunk_latency") or none,
        tpot_s=_aiperf_percentiles(document, "inter_token_latency"),
        e2e_s=_aiperf_percentiles(document, "request_latency"),
    )


def parse_orcapod_bench(document: dict[str, Any], target: str, max_tokens: int) -> Summary:
    """A Summary of ``orcapod bench``'s JSON (one rate).

    It reports normalized latency (e2e / generated tokens), not e2e; with
    ``ignore_eos`` every completed request generates exactly ``max_tokens``,
    so e2e p50/p99 = normalized p50/p99 × max_tokens. Where the mean says
    otherwise (a request stopped early), e2e is left out.
    """
    (run,) = document["runs"]
    client = run["client"]
    rps, tok_s = client["throughput_rps"], client["throughput_tok_s"]
    mean_tokens = tok_s / rps if rps > 0 else None
    e2e = None
    if mean_tokens is not None and abs(mean_tokens - max_tokens) < 0.01:
        normalized = client["normalized_latency_s"]
        e2e = Percentiles(
            *(None if normalized[q] is None else normalized[q] * max_tokens for q in ("p50", "p99"))
        )
    return Summary(
        tool="orcapod bench",
        target=target,
        num_completed=client["num_completed"],
        num_errors=client["num_errors"],
        requests_per_s=rps,
        output_tokens_per_s=tok_s,
        mean_output_tokens=mean_tokens,
        cached_prompt_pct=None,
        ttft_s=Percentiles(client["ttft_s"]["p50"], client["ttft_s"]["p99"]),
        itl_s=Percentiles(client["itl_s"]["p50"], client["itl_s"]["p99"]),
        tpot_s=None,
        e2e_s=e2e,
    )


def check_loopback(url: str) -> None:
    """Refuse any URL off this machine: this benchmarks services here, never someone else's."""
    from orcapod.bench.loadgen import LOOPBACK_HOSTS

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK_HOSTS:
        raise SystemExit(f"{url!r}: only http://127.0.0.1:PORT (loopback) is benchmarked")


def websocket_url(http_url: str) -> str:
    """http://host:port -> ws://host:port/ws (the same gateway's websocket)."""
    parts = urlsplit(http_url)
    scheme = {"http": "ws", "https": "wss"}[parts.scheme]
    return f"{scheme}://{parts.netloc}/ws"


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


TABLE_HEADER = (
    "| tool | target | done | err | cached % | req/s | out tok/s | TTFT p50 s | TTFT p99 s "
    "| ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms | e2e p50 s | e2e p99 s |"
)


def table(summaries: Sequence[Summary]) -> str:
    """A markdown table, one row per run."""
    rows = [TABLE_HEADER, "|---|---|" + "---:|" * 13]
    for s in summaries:
        tpot = s.tpot_s or Percentiles(None, None)
        e2e = s.e2e_s or Percentiles(None, None)
        cells = [
            s.tool, s.target, str(s.num_completed), str(s.num_errors),
            _fmt(s.cached_prompt_pct, digits=0),
            _fmt(s.requests_per_s, digits=3), _fmt(s.output_tokens_per_s, digits=1),
            _fmt(s.ttft_s.p50), _fmt(s.ttft_s.p99),
            _fmt(s.itl_s.p50, 1000, 0), _fmt(s.itl_s.p99, 1000, 0),
            _fmt(tpot.p50, 1000, 0), _fmt(tpot.p99, 1000, 0),
            _fmt(e2e.p50), _fmt(e2e.p99),
        ]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# --- processes ------------------------------------------------------------------------


def ensure_aiperf(venv: Path) -> Path:
    """The ``aiperf`` executable in ``venv``, installed there on first use."""
    aiperf = venv / "bin" / "aiperf"
    if not aiperf.exists():
        log(f"installing aiperf=={AIPERF_VERSION} into {venv} (about 2 minutes) ...")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True
        )
    return aiperf


def tool_environment() -> dict[str, str]:
    """The environment AIPerf runs in: no way to the hub (see the module docstring)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.update(HF_ENDPOINT=CLOSED_HUB, HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")
    return env


def served_model(url: str, api_key: str | None) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    request = urllib.request.Request(f"{url}/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(json.load(response)["data"][0]["id"])


@contextlib.contextmanager
def own_orcapod(log_path: Path) -> Iterator[str]:
    """``orcapod up`` on its own redis-server (caps lifted); yields its HTTP URL."""
    from orcapod.bench.service import benchmark_redis, orcapod_up

    with benchmark_redis() as redis, orcapod_up(redis.url, "fair", log_path) as ws_url:
        yield ws_url.replace("ws://", "http://", 1).removesuffix("/ws")


def run_aiperf(
    args: argparse.Namespace, aiperf: Path, url: str, target: str, load: Load, results: Path
) -> tuple[Summary, dict[str, Any]]:
    api_key = args.api_key if target == args.name else args.peer_api_key
    model = served_model(url, api_key)
    artifact_dir = results / f"aiperf-{target}"
    command = aiperf_command(
        aiperf, url, model, load, args.tokenizer, artifact_dir, args.endpoint, api_key
    )
    log(f"aiperf -> {target} ({url}, model {model}) ...")
    started = time.monotonic(), _children_cpu_s()
    with (results / f"aiperf-{target}.log").open("wb") as log_file:
        completed = subprocess.run(
            command, env=tool_environment(), stdout=log_file, stderr=subprocess.STDOUT
        )
    if completed.returncode != 0:
        raise SystemExit(f"aiperf failed ({completed.returncode}); see {log_file.name}")
    document = json.loads((artifact_dir / "profile_export_aiperf.json").read_text())
    summary = parse_aiperf(document, target)
    if (summary.cached_prompt_pct or 0) > 1:
        log(
            f"note: {target} served {summary.cached_prompt_pct:.0f}% of the prompt tokens from "
            "its cache (this --seed ran against it before): TTFT is not a cold prefill"
        )
    return _run_entry(summary, command, started, api_key)


def run_orcapod_bench(
    args: argparse.Namespace, url: str, load: Load, results: Path
) -> tuple[Summary, dict[str, Any]]:
    out = results / "orcapod-bench.json"
    command = orcapod_bench_command(websocket_url(url), load, out, args.api_key)
    log("orcapod bench -> orcapod ...")
    started = time.monotonic(), _children_cpu_s()
    with (results / "orcapod-bench.log").open("wb") as log_file:
        subprocess.run(
            command, check=True, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT
        )
    summary = parse_orcapod_bench(json.loads(out.read_text()), args.name, load.output_tokens)
    return _run_entry(summary, command, started, args.api_key)


def _children_cpu_s() -> float:
    """CPU seconds of the finished children (a tool's run, its own subprocesses included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_entry(
    summary: Summary, command: list[str], started: tuple[float, float], api_key: str | None
) -> tuple[Summary, dict[str, Any]]:
    shown = ["***" if api_key and part == api_key else part for part in command]
    wall_s = time.monotonic() - started[0]
    return summary, {
        "summary": asdict(summary),
        "command": " ".join(shown),
        "wall_s": round(wall_s, 1),
        # The load generator's own CPU: it shares the 2 cores with the service.
        "client_cpu_s": round(_children_cpu_s() - started[1], 1),
        "loadavg_1m_after": loadavg_1m(),  # other work on the machine
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--url", help="orcapod's gateway, http://127.0.0.1:PORT (default: start one)"
    )
    parser.add_argument("--api-key", help="orcapod's API key (sent as a Bearer token)")
    parser.add_argument("--peer-url", help="another OpenAI-compatible server, for AIPerf only")
    parser.add_argument("--peer-api-key")
    parser.add_argument("--peer-name", default="peer", help="the peer's name in the table")
    parser.add_argument(
        "--llama-server", action="store_true", help="start llama-server as the peer"
    )
    add_llama_arguments(parser)
    parser.add_argument("--rate", type=float, default=Load.rate_rps, help="Poisson arrivals, req/s")
    parser.add_argument("--duration", type=float, default=Load.duration_s, help="s of arrivals")
    parser.add_argument("--grace", type=float, default=Load.grace_s, help="s to wait after")
    parser.add_argument("--prompt-tokens", type=int, default=Load.prompt_tokens)
    parser.add_argument("--output-tokens", type=int, default=Load.output_tokens)
    parser.add_argument("--seed", type=int, default=Load.seed)
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--tool-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--skip-orcapod-bench", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "openai_load.json")
    parser.add_argument("--name", default="orcapod", help="--url's name in the table")
    args = parser.parse_args(argv)
    if args.peer_url and args.llama_server:
        parser.error("--peer-url and --llama-server are two ways to name the peer; pick one")
    for url in (args.url, args.peer_url):
        if url:
            check_loopback(url)
    if not (args.tokenizer / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer.json in {args.tokenizer}")
    load = Load(args.prompt_tokens, args.output_tokens, args.rate, args.duration, args.grace,
                args.seed)  # fmt: skip
    aiperf = ensure_aiperf(args.tool_venv.expanduser())
    results = args.out.with_suffix("")  # logs and the tools' own files
    results.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "machine": lscpu_machine(),
        "load": asdict(load),
        "endpoint": args.endpoint,
        "tokenizer": str(args.tokenizer),
        "runs": [],
    }
    runs: list[tuple[Summary, dict[str, Any]]] = []
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(own_orcapod(results / "orcapod-up.log"))
        runs.append(run_aiperf(args, aiperf, url.rstrip("/"), args.name, load, results))
        if not args.skip_orcapod_bench:
            time.sleep(SETTLE_S)
            runs.append(run_orcapod_bench(args, url.rstrip("/"), load, results))
    if args.peer_url or args.llama_server:
        time.sleep(SETTLE_S)  # orcapod (when it was ours) has stopped: the peer runs alone
        with contextlib.ExitStack() as stack:
            peer = args.peer_url or stack.enter_context(
                llama_server(args.llama_cache_dir.expanduser(), args.llama_threads,
                             LLAMA_SLOTS, LLAMA_CONTEXT, results / "llama-server.log",
                             alias=DEFAULT_TOKENIZER.name)
            )  # fmt: skip
            target = "llama-server" if args.llama_server else args.peer_name
            runs.append(run_aiperf(args, aiperf, peer.rstrip("/"), target, load, results))
    document["machine"]["loadavg_1m_after"] = f"{loadavg_1m():.2f}"
    document["runs"] = [entry for _, entry in runs]
    print()
    print(table([summary for summary, _ in runs]))
    write_json(args.out, document, indent=1)
    print(f"\nwrote {args.out} (the tools' own files: {results}/)")


if __name__ == "__main__":
    main()
