"""Replay a token-id trace (``traces.py``: the Orca trace) open loop against any
OpenAI-compatible ``/v1/completions``: orcapod's gateway or llama.cpp's
``llama-server``, through the same client, so both serve the same arrivals and
prompts.

Each request is sent at its arrival time, whether or not earlier ones have
finished: ``prompt`` as token ids, ``max_tokens`` with ``ignore_eos`` (exactly
that many tokens come back), greedy, streamed. Streaming over aiohttp, loopback
only, like the multi-turn driver.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from orcapod.bench.loadgen import LoadError
from orcapod.bench.multiturn import Endpoint, check_http_loopback, served_model
from orcapod.bench.traces import TraceRequest
from shared.settings import auth_headers


@dataclass(frozen=True)
class CompletionRecord:
    """One request of the replay; times in seconds after the run started."""

    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    first_token_s: float | None
    end_s: float
    completion_tokens: int
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.completion_tokens == self.max_tokens


class _Stream:
    """Server-sent events of one streamed completion: when text first came, and the
    tokens the server counted (``usage``) or, without it, the chunks that carried text."""

    def __init__(self) -> None:
        self.first_token_s: float | None = None
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.done = False

    def feed(self, line: bytes, now_s: float) -> None:
        text = line.decode("utf-8", errors="replace").strip()
        if not text.startswith("data:"):
            return
        data = text.removeprefix("data:").strip()
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        usage = event.get("usage")
        if usage:
            self.usage_tokens = int(usage.get("completion_tokens", 0))
        for choice in event.get("choices") or ():
            if choice.get("text"):
                self.chunks += 1
                if self.first_token_s is None:
                    self.first_token_s = now_s

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks


async def replay(
    endpoint: Endpoint, trace: list[TraceRequest], progress: bool = True
) -> tuple[str, list[CompletionRecord]]:
    """The served model's name and one record per request of ``trace``."""
    check_http_loopback(endpoint.base_url)
    timeout = aiohttp.ClientTimeout(total=endpoint.turn_timeout_s)
    # A connection per request: llama-server closes idle keep-alive connections.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=auth_headers(endpoint.api_key)
    ) as session:
        model = await served_model(session, endpoint)
        warm_up = TraceRequest(-1, 0.0, 2, True, "warm-up", prompt_token_ids=(1_000, 1_001))
        record = await _complete(session, endpoint, model, warm_up, time.monotonic())
        if not record.completed:
            raise LoadError(f"{endpoint.name}: the warm-up request failed: {record.error}")
        records: list[CompletionRecord] = []
        with tqdm(total=len(trace), desc=endpoint.name, disable=not progress) as bar:
            started_s = time.monotonic()

            async def one(request: TraceRequest) -> None:
                await asyncio.sleep(max(0.0, started_s + request.arrival_s - time.monotonic()))
                records.append(await _complete(session, endpoint, model, request, started_s))
                bar.update(1)

            async with asyncio.TaskGroup() as tasks:
                for request in trace:
                    tasks.create_task(one(request))
    return model, sorted(records, key=lambda record: record.index)


async def _complete(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    model: str,
    request: TraceRequest,
    started_s: float,
) -> CompletionRecord:
    body = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.max_tokens,
        "ignore_eos": request.ignore_eos,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **endpoint.extra_body,
    }
    stream = _Stream()
    error: str | None = None
    try:
        async with session.post(f"{endpoint.api_url}/completions", json=body) as response:
            if response.status != 200:
                error = f"HTTP {response.status}: {(await response.text())[:200]}"
            else:
                async for line in response.content:
                    stream.feed(line, time.monotonic() - started_s)
                    if stream.done:
                        break
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as failure:
        error = f"{type(failure).__name__}: {failure}"
    if error is None and not stream.done:
        error = "the stream ended without [DONE]"
    return CompletionRecord(
        index=request.index,
        arrival_s=request.arrival_s,
        prompt_tokens=request.num_prompt_tokens,
        max_tokens=request.max_tokens,
        first_token_s=stream.first_token_s,
        end_s=time.monotonic() - started_s,
        completion_tokens=stream.tokens,
        error=error,
    )


def summarize(records: list[CompletionRecord], offered_rps: float) -> dict[str, Any]:
    """Throughput over the run (first arrival to last answer) and latencies of the
    requests that completed; ``normalized`` is latency per generated token (Orca's)."""
    done = [record for record in records if record.completed]
    if not done:
        return {"offered_rps": offered_rps, "requests": len(records), "completed": 0}
    span_s = max(record.end_s for record in done) - min(record.arrival_s for record in records)
    normalized = [(r.end_s - r.arrival_s) / r.max_tokens for r in done]
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    return {
        "offered_rps": offered_rps,
        "requests": len(records),
        "completed": len(done),
        "span_s": span_s,
        "completed_rps": len(done) / span_s,
        "output_tokens_per_s": sum(r.completion_tokens for r in done) / span_s,
        "normalized_latency_p50_s": statistics.median(normalized),
        "normalized_latency_p90_s": statistics.quantiles(normalized, n=10)[-1]
        if len(normalized) > 1
        else normalized[0],
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
