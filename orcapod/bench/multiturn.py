"""The multi-turn benchmark's driver: every conversation of a trace
(``multiturn_trace.py``) at once against one OpenAI-compatible
``/v1/chat/completions`` (orcapod's gateway, llama.cpp's ``llama-server``).

Streaming, over aiohttp (the gateway's own dependency, so ``orcapod bench``
needs nothing from the test extras), and only on loopback. Per turn it
records TTFT (send to the first content token), latency and the server's
token counts (``multiturn_report.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import redis
from tqdm import tqdm

from orcapod.bench.loadgen import LOOPBACK_HOSTS, LoadError
from orcapod.bench.multiturn_report import (
    TurnRecord,
    TurnStream,
    cache_counters,
    service_cache,
    summarize_run,
)
from orcapod.bench.multiturn_trace import (
    WARM_UP_MESSAGE,
    Conversation,
    MultiturnTrace,
    turn_messages,
)
from shared.keys import RedisKeys
from shared.settings import auth_headers

COUNTER_FLUSH_S = 1.5  # the scheduler adds its cache counters to Redis a few times a second


def check_http_loopback(url: str) -> None:
    """Refuse any URL that is not HTTP on this machine."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK_HOSTS:
        raise LoadError(f"{url!r}: the multiturn benchmark only talks to http://127.0.0.1")


def http_base_url(websocket_url: str) -> str:
    """ws://host:port/ws -> http://host:port (the same gateway's HTTP side)."""
    parts = urlsplit(websocket_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return f"{scheme}://{parts.netloc}"


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: ``base_url`` is http://127.0.0.1:PORT (``/v1`` optional);
    ``extra_body`` joins every request (llama-server: ``{"cache_prompt": true}``)."""

    name: str
    base_url: str
    api_key: str | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    turn_timeout_s: float = 300.0

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1") + "/v1"


async def served_model(session: aiohttp.ClientSession, endpoint: Endpoint) -> str:
    """The first model ``GET /v1/models`` lists (what requests name in ``model``)."""
    try:
        async with session.get(f"{endpoint.api_url}/models") as response:
            if response.status != 200:
                body = (await response.text())[:200]
                raise LoadError(f"GET {response.url}: {response.status} {body}")
            return str((await response.json())["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError) as error:
        raise LoadError(f"cannot reach {endpoint.api_url}: {error}") from error


@dataclass(frozen=True)
class MultiturnResult:
    """Every turn's record and the run's wall time (first send to last answer)."""

    model: str
    records: list[TurnRecord]
    wall_s: float


class MultiturnDriver:
    """Runs every conversation of a trace at once against one endpoint."""

    def __init__(self, endpoint: Endpoint, trace: MultiturnTrace, progress: bool = True) -> None:
        check_http_loopback(endpoint.base_url)
        self.endpoint = endpoint
        self.trace = trace
        self._records: list[TurnRecord] = []
        self._progress = progress
        self._model = ""

    async def run(self, on_start: Callable[[], None] | None = None) -> MultiturnResult:
        """A warm-up turn (the system prompt, not recorded), ``on_start()``, then the
        conversations."""
        spec = self.trace.spec
        timeout = aiohttp.ClientTimeout(total=self.endpoint.turn_timeout_s)
        # A connection per turn: llama-server closes idle keep-alive connections, and a
        # reused one that it closed fails the turn ("Can not write request body").
        connector = aiohttp.TCPConnector(limit=spec.num_conversations + 1, force_close=True)
        headers = auth_headers(self.endpoint.api_key)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=headers
        ) as session:
            self._model = await served_model(session, self.endpoint)
            warm_up = Conversation(-1, (WARM_UP_MESSAGE,))
            record, _ = await self._turn(session, warm_up, [], max_tokens=4)
            if not record.completed:
                raise LoadError(f"{self.endpoint.name}: the warm-up turn failed: {record.error}")
            if on_start is not None:
                on_start()
            total = spec.num_conversations * spec.num_turns
            with tqdm(total=total, desc=self.endpoint.name, disable=not self._progress) as bar:
                started_s = time.monotonic()
                async with asyncio.TaskGroup() as tasks:
                    for conversation in self.trace.conversations:
                        tasks.create_task(self._converse(session, conversation, bar))
        ends = [record.sent_s + record.latency_s for record in self._records]
        wall_s = max(ends, default=started_s) - started_s
        records = sorted(self._records, key=lambda r: (r.conversation, r.turn))
        return MultiturnResult(self._model, records, wall_s)

    async def _converse(
        self, session: aiohttp.ClientSession, conversation: Conversation, bar: tqdm
    ) -> None:
        answers: list[str] = []
        for _ in conversation.user_messages:
            record, answer = await self._turn(session, conversation, answers)
            self._records.append(record)
            bar.update(1)
            if not record.completed:  # without its answer the history cannot go on
                bar.update(len(conversation.user_messages) - record.turn)
                return
            answers.append(answer)

    async def _turn(
        self,
        session: aiohttp.ClientSession,
        conversation: Conversation,
        answers: list[str],
        max_tokens: int | None = None,
    ) -> tuple[TurnRecord, str]:
        body = {
            "model": self._model,
            "messages": turn_messages(self.trace.system_prompt, conversation, answers),
            "max_tokens": max_tokens or self.trace.spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.endpoint.extra_body,
        }
        stream = TurnStream(time.monotonic())
        try:
            async with session.post(f"{self.endpoint.api_url}/chat/completions", json=body) as r:
                if r.status != 200:
                    stream.fail(f"HTTP {r.status}: {(await r.text())[:200]}")
                else:
                    async for line in r.content:
                        stream.feed(line, time.monotonic())
                        if stream.done:
                            break
        except (aiohttp.ClientError, TimeoutError) as error:
            stream.fail(f"{type(error).__name__}: {error}")
        record = stream.record(conversation.index, len(answers) + 1, time.monotonic())
        return record, stream.text


def measure(
    endpoint: Endpoint,
    trace: MultiturnTrace,
    redis_url: str | None = None,
    prefix: str = "orcapod",
    progress: bool = True,
) -> dict[str, Any]:
    """One run of ``trace`` against ``endpoint``: its summary, every turn's record, and
    (with ``redis_url``, an orcapod's Redis) the scheduler's cache counters over the run."""
    client = redis.Redis.from_url(redis_url) if redis_url else None
    key = RedisKeys(prefix).prefix_cache
    before: dict[str, int] = {}

    def snapshot() -> None:  # after the warm-up turn, which is no part of the run
        if client is not None:
            time.sleep(COUNTER_FLUSH_S)  # the warm-up's counts have reached the hash
            before.update(cache_counters(client.hgetall(key)))  # type: ignore[arg-type]

    try:
        try:
            result = asyncio.run(MultiturnDriver(endpoint, trace, progress).run(snapshot))
        except* LoadError as group:
            raise group.exceptions[0] from None
        summary = summarize_run(result.records, result.wall_s)
        if client is not None:
            time.sleep(COUNTER_FLUSH_S)
            after = cache_counters(client.hgetall(key))  # type: ignore[arg-type]
            summary["service_cache"] = service_cache(before, after)
    finally:
        if client is not None:
            client.close()
    return {
        "endpoint": endpoint.name,
        "url": endpoint.base_url,
        "model": result.model,
        **summary,
        "records": [asdict(record) for record in result.records],
    }
