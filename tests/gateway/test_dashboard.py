"""The dashboard's data path, end to end: the scheduler's live view in Redis,
pushed to `/dashboard/ws` as each viewer may see it (other tenants' names
hidden unless the viewer is an operator), the same keys and origins as `/ws`;
and the pages' headers."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from websockets.asyncio.client import ClientConnection, connect

from gateway.dashboard import Pseudonyms, view_frame
from gateway.server import GatewayServer
from gateway.tenants import Tenant, hash_key, tenant_toml
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits
from shared.live_stats import (
    LiveSnapshot,
    StepRecord,
    TenantLive,
    WorkerLive,
    encode_snapshot,
)
from tests.conftest import RedisServer
from tests.gateway.test_server import KEYS, TIMEOUT_S, FakeUpstream, run_with_gateway

SNAPSHOT = LiveSnapshot(
    time_ms=1_700_000_000_000,
    policy="fair",
    num_waiting=3,
    workers=[
        WorkerLive(
            worker_id="worker-0",
            blocks_used=12,
            blocks_cached=0,
            blocks_total=100,
            num_running=2,
            steps=[
                StepRecord(7, 2, 48, 1, 1, 0, 3.5, "graph[1]"),
                StepRecord(8, 2, 0, 2, 0, 1, None),
            ],
        )
    ],
    tenants=[
        TenantLive("alice", 120.0, 1, 1),
        TenantLive("<script>bob</script>", 80.0, 2, 1),
    ],
)


def test_a_viewer_sees_its_own_name_and_pseudonyms_for_the_others() -> None:
    pseudonyms = Pseudonyms(b"k" * 16)
    frame = json.loads(view_frame(SNAPSHOT, "alice", False, pseudonyms))
    assert frame["type"] == "snapshot" and frame["operator"] is False
    [alice, bob] = frame["tenants"]
    assert (alice["tenant"], alice["you"]) == ("alice", True)
    assert bob["tenant"].startswith("tenant ") and "bob" not in bob["tenant"]
    assert bob["you"] is False and bob["service"] == 80.0
    # Stable: the same pseudonym every time, another for another name.
    again = json.loads(view_frame(SNAPSHOT, "alice", False, pseudonyms))
    assert again["tenants"][1]["tenant"] == bob["tenant"]
    assert pseudonyms.of("carol") != bob["tenant"]
    assert Pseudonyms().of("<script>bob</script>") != bob["tenant"]  # keyed per gateway
    operator = json.loads(view_frame(SNAPSHOT, "ops", True, pseudonyms))
    assert [t["tenant"] for t in operator["tenants"]] == ["alice", "<script>bob</script>"]
    [worker] = frame["workers"]
    assert worker["steps"][0] == {
        "step_index": 7,
        "num_requests": 2,
        "num_prefill_tokens": 48,
        "num_decode_tokens": 1,
        "num_joined": 1,
        "num_left": 0,
        "step_ms": 3.5,
        "path": "graph[1]",
        "stage_ms": [],  # one engine: no stages
    }
    assert worker["steps"][1]["step_ms"] is None and worker["steps"][1]["path"] == ""
    assert worker["pipeline_depth"] == 1


async def next_frame(socket: ClientConnection) -> Any:
    return json.loads(await asyncio.wait_for(socket.recv(), TIMEOUT_S))


def dashboard_url(server: GatewayServer) -> str:
    return server.url.removesuffix("/ws") + "/dashboard/ws"


def test_dashboard_sockets_get_the_live_view_as_their_tenant_may_see_it(
    redis_server: RedisServer,
    chat_tokenizer: ChatTokenizer,
    model_limits: ModelLimits,
    tmp_path: Path,
) -> None:
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text(
        tenant_toml(Tenant(name="alice"), [hash_key("opk_alice")])
        + tenant_toml(Tenant(name="ops", operator=True), [hash_key("opk_ops")])
    )

    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        url = dashboard_url(server)
        # No scheduler publishing yet: said so, then the view once it is there.
        async with connect(url, subprotocols=["orcapod", "bearer.opk_alice"]) as alice:  # type: ignore[list-item]
            assert alice.subprotocol == "orcapod"
            assert (await next_frame(alice))["type"] == "unavailable"
            await upstream.redis.set(KEYS.live_stats, encode_snapshot(SNAPSHOT), px=5000)
            frame = await next_frame(alice)
            assert frame["type"] == "snapshot" and frame["num_waiting"] == 3
            names = [t["tenant"] for t in frame["tenants"]]
            assert names[0] == "alice" and "bob" not in names[1]
            # A newer snapshot comes within a few publish intervals.
            newer = msgspec.structs.replace(SNAPSHOT, num_waiting=9)
            await upstream.redis.set(KEYS.live_stats, encode_snapshot(newer), px=5000)
            started_s = time.monotonic()
            while (await next_frame(alice))["num_waiting"] != 9:
                pass
            assert time.monotonic() - started_s < 2.0
        async with connect(url, additional_headers={"Authorization": "Bearer opk_ops"}) as ops:
            frame = await next_frame(ops)
            assert frame["operator"] is True
            assert "<script>bob</script>" in [t["tenant"] for t in frame["tenants"]]
        # The same doors as /ws: no key, a foreign page.
        for headers in ({}, {"Origin": "http://evil.example", "Authorization": "Bearer opk_ops"}):
            with pytest.raises(Exception) as refused:
                async with connect(url, additional_headers=headers):
                    pass
            assert refused.value.response.status_code in (401, 403)
        # Whatever a dashboard socket sends is ignored; a big frame closes it.
        async with connect(url, additional_headers={"Authorization": "Bearer opk_ops"}) as ops:
            await next_frame(ops)
            await ops.send("hello")
            newest = msgspec.structs.replace(SNAPSHOT, num_waiting=11)
            await upstream.redis.set(KEYS.live_stats, encode_snapshot(newest), px=5000)
            assert (await next_frame(ops))["type"] == "snapshot"
            await ops.send("x" * 4096)
            await asyncio.wait_for(ops.wait_closed(), TIMEOUT_S)
            assert ops.close_code == 1009

    run_with_gateway(
        redis_server, chat_tokenizer, model_limits, scenario, tenants_file=tenants_file
    )


def test_the_pages_are_served_with_their_headers(
    redis_server: RedisServer, chat_tokenizer: ChatTokenizer, model_limits: ModelLimits
) -> None:
    async def scenario(server: GatewayServer, upstream: FakeUpstream) -> None:
        async with aiohttp.ClientSession() as session:
            for path in ("/", "/dashboard"):
                async with session.get(f"{server.http_url}{path}") as response:
                    assert response.status == 200, path
                    assert response.content_type == "text/html"
                    policy = response.headers["Content-Security-Policy"]
                    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
                    assert response.headers["X-Content-Type-Options"] == "nosniff"
            for path in ("/static/../server.py", "/static/%2e%2e/server.py", "/static/nope.js"):
                async with session.get(f"{server.http_url}{path}") as response:
                    assert response.status in (403, 404), path

    run_with_gateway(redis_server, chat_tokenizer, model_limits, scenario)
