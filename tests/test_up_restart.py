"""`orcapod up` survives a crashed child: the restart rule on a given clock, the
embedded Redis's memory cap, and for real: `kill -9` of the worker, a new
worker process under the same id, and the service answers again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from redis.exceptions import OutOfMemoryError, RedisError

from orcapod.embedded_redis import (
    EmbeddedRedisError,
    remove_data,
    start_embedded_redis,
)
from orcapod.processes import CrashLoopError, RestartBackoff, RestartPolicy, stop_children
from tests.conftest import descendants, free_port
from tests.test_up import _generate
from tests.up_process import UpProcess


def test_the_delay_doubles_to_its_cap_and_starts_over_after_a_long_run():
    backoff = RestartBackoff(RestartPolicy(max_restarts=100))
    now_s = 0.0
    delays = []
    for _ in range(7):
        delays.append(backoff.next_delay_s(now_s, ran_s=1.0))
        now_s += 1.0
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.next_delay_s(now_s, ran_s=60.0) == 0.5
    assert backoff.next_delay_s(now_s + 1, ran_s=1.0) == 1.0


def test_more_than_five_restarts_within_a_minute_is_a_crash_loop():
    backoff = RestartBackoff(RestartPolicy())
    now_s = 0.0
    for _ in range(5):
        now_s += backoff.next_delay_s(now_s, ran_s=0.1) + 0.1
    with pytest.raises(CrashLoopError, match="5 times within 60 s"):
        backoff.next_delay_s(now_s, ran_s=0.1)


def test_restarts_spread_over_more_than_a_minute_go_on():
    backoff = RestartBackoff(RestartPolicy())
    for number in range(20):
        backoff.next_delay_s(number * 20.0, ran_s=19.0)  # 3 in any minute


def test_the_embedded_redis_is_capped_and_refuses_writes_when_full():
    embedded = start_embedded_redis(maxmemory="2mb")
    try:
        client = redis.Redis.from_url(embedded.url)
        assert client.config_get("maxmemory") == {"maxmemory": str(2 << 20)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        with pytest.raises(OutOfMemoryError, match="maxmemory") as refused:
            for number in range(10_000):
                client.set(f"k{number}", b"x" * 4096)
        # Every actor's retry loop catches RedisError: OOM is one of them.
        assert isinstance(refused.value, RedisError)
        client.close()
    finally:
        stop_children([embedded.child])
        remove_data(embedded)


def test_a_maxmemory_that_could_inject_config_is_refused():
    with pytest.raises(EmbeddedRedisError):
        start_embedded_redis(maxmemory="1mb\nrequirepass x")


def _worker_pids(launcher_pid: int) -> list[int]:
    return [pid for pid, cmd in descendants(launcher_pid) if "--worker-id worker-0" in cmd]


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return int(response.status)
    except OSError:
        return 0


@pytest.fixture
def one_gateway(prepared_model_dir):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = UpProcess(
        [
            *("--port", str(port), "--model", str(prepared_model_dir)),
            "--worker-arg=--kv-cache-bytes=67108864",
            "--redis-maxmemory=256mb",
        ],
        env,
    )
    up.wait_ready()
    yield up, port
    up.stop()


def test_a_killed_worker_comes_back_and_the_service_answers_again(one_gateway):
    up, port = one_gateway
    process = up.process
    [old_pid] = _worker_pids(process.pid)
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    new_pids: list[int] = []
    while not new_pids or new_pids == [old_pid]:
        assert time.monotonic() < deadline, "no new worker process"
        new_pids = [pid for pid in _worker_pids(process.pid) if pid != old_pid]
        time.sleep(0.2)
    assert process.poll() is None  # the launcher did not stop the service
    while _healthz(port) != 200:
        assert time.monotonic() < deadline + 30, "healthz did not come back"
        time.sleep(0.5)
    _, done = asyncio.run(_generate(f"ws://127.0.0.1:{port}/ws", "Say hello.", max_tokens=4))
    assert done.finish_reason in ("stop", "length") and done.usage.completion_tokens >= 1
    seen = up.drain()
    restarts = [line for line in seen if "worker-0 exited with code -9; restarting it" in line]
    assert len(restarts) == 1, seen[-20:]
    # The launcher stops cleanly afterwards, the new worker with it.
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert not Path(f"/proc/{new_pids[0]}").exists() or (
        "Z" in Path(f"/proc/{new_pids[0]}/stat").read_text().split()[2]
    )
