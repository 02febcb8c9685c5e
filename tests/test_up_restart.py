"""`orcapod up` survives a crashed child: the restart rule on a given clock, the
embedded Redis's memory cap, and for real: `kill -9` of the worker, a new
worker process under the same id, and the service answers again; `kill -9` of
the embedded redis-server under load, the same server back and every stream
complete exactly once; the data folder gone however the launcher stops."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from redis.exceptions import OutOfMemoryError, RedisError
from websockets.asyncio.client import connect

from orcapod.embedded_redis import (
    EmbeddedRedisError,
    process_start_ticks,
    remove_data,
    start_embedded_redis,
)
from orcapod.processes import CrashLoopError, RestartBackoff, RestartPolicy, stop_children
from shared.keys import RedisKeys
from shared.lifeline import GRACE_S
from shared.settings import redis_settings
from tests.conftest import descendants, free_port
from tests.faults.cluster import (
    Stream,
    assert_exactly_once,
    each_has_tokens,
    longest_gap_s,
    read_into,
    run_requests,
    seconds_to_last_token,
    send_requests,
)
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


REDIS_LINE = re.compile(r"embedded redis-server on 127\.0\.0\.1:(?P<port>\d+)/")
RESTART_LINE = re.compile(
    r"orcapod up: (?P<name>\S+) exited with code (?P<code>-?\d+); restarting it in \S+ s"
)


def _restarts(lines: list[str]) -> list[tuple[str, int]]:
    """(child, exit code) of each restart the launcher announced."""
    found = [RESTART_LINE.search(line) for line in lines]
    return [(match["name"], int(match["code"])) for match in found if match]


def _wait_line(up: UpProcess, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
    deadline_s = time.monotonic() + timeout_s
    while True:
        for line in up.drain():
            if match := pattern.search(line):
                return match
        assert time.monotonic() < deadline_s, f"no line like {pattern.pattern}: {up.output[-20:]}"
        time.sleep(0.05)


def _embedded_redis(launcher_pid: int) -> tuple[int, Path]:
    """The launcher's redis-server: its pid and its data folder (where it works)."""
    [pid] = [pid for pid, cmd in descendants(launcher_pid) if "redis-server" in cmd]
    return pid, Path(os.readlink(f"/proc/{pid}/cwd"))


def _worker_pids(launcher_pid: int) -> list[int]:
    return [pid for pid, cmd in descendants(launcher_pid) if "--worker-id worker-0" in cmd]


def _new_worker_pid(launcher_pid: int, old_pid: int) -> int:
    """The pid of the worker the launcher started after ``old_pid`` died."""
    deadline = time.monotonic() + 30
    while True:
        new_pids = [pid for pid in _worker_pids(launcher_pid) if pid != old_pid]
        if new_pids:
            return new_pids[0]
        assert time.monotonic() < deadline, "no new worker process"
        time.sleep(0.1)


def _stop_like_a_supervisor(up: UpProcess) -> set[int]:
    """SIGTERM to the launcher's process group, SIGKILL 2 s later (what a
    supervisor or a CI runner does when a stop takes long); every process of the
    service seen meanwhile."""
    launcher = up.process
    seen = {pid for pid, _ in descendants(launcher.pid)}
    os.killpg(launcher.pid, signal.SIGTERM)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        seen |= {pid for pid, _ in descendants(launcher.pid)}
        time.sleep(0.1)
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    return seen


def _left_after(pids: set[int], timeout_s: float) -> set[int]:
    """Those of ``pids`` still running ``timeout_s`` from now (or as soon as none is)."""
    deadline = time.monotonic() + timeout_s
    while (
        left := {pid for pid in pids if process_start_ticks(pid)}
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


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
        own_group=True,
    )
    up.wait_ready()
    yield up, port
    up.stop()


def test_a_killed_worker_comes_back_and_a_supervisors_stop_during_the_next_restart_leaves_nothing(
    one_gateway,
):
    """kill -9 of the worker: a new worker process under the same id, and the
    service answers again. Killed again, and while that worker starts the
    launcher's group gets SIGTERM, then SIGKILL 2 s later (a supervisor's stop
    that took too long): no process of the service is left a few seconds later
    (the audit found such a worker running on with parent 1)."""
    up, port = one_gateway
    process = up.process
    [old_pid] = _worker_pids(process.pid)
    os.kill(old_pid, signal.SIGKILL)
    new_pid = _new_worker_pid(process.pid, old_pid)
    assert process.poll() is None  # the launcher did not stop the service
    deadline = time.monotonic() + 60
    while _healthz(port) != 200:
        assert time.monotonic() < deadline, "healthz did not come back"
        time.sleep(0.5)
    _, done = asyncio.run(_generate(f"ws://127.0.0.1:{port}/ws", "Say hello.", max_tokens=4))
    assert done.finish_reason in ("stop", "length") and done.usage.completion_tokens >= 1
    seen = up.drain()
    restarts = [line for line in seen if "worker-0 exited with code -9; restarting it" in line]
    assert len(restarts) == 1, seen[-20:]

    os.kill(new_pid, signal.SIGKILL)
    _new_worker_pid(process.pid, new_pid)
    service = _stop_like_a_supervisor(up)
    # redis-server, scheduler, worker, gateway; the new worker's engine process too
    # where its start got that far within the 2 s (on a loaded machine it may not).
    assert len(service) >= 4
    assert not _left_after(service, GRACE_S + 5)


@pytest.mark.parametrize("stop", ["term-then-kill-group", "kill-9-launcher"])
def test_a_launcher_stopped_during_start_up_leaves_no_process(prepared_model_dir, stop):
    """Stopped as soon as its worker runs (loading the model): by a supervisor
    (SIGTERM to the group, SIGKILL 2 s later) or by kill -9 of `orcapod up`
    alone; every process it started is gone a few seconds later."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = UpProcess(
        ["--port", str(free_port()), "--model", str(prepared_model_dir)], env, own_group=True
    )
    try:
        deadline = time.monotonic() + 60
        while not _worker_pids(up.process.pid):
            assert up.process.poll() is None and time.monotonic() < deadline, up.drain()[-20:]
            time.sleep(0.05)
        if stop == "kill-9-launcher":
            service = {pid for pid, _ in descendants(up.process.pid)}
            up.process.kill()
            up.process.wait(timeout=10)
        else:
            service = _stop_like_a_supervisor(up)
        assert not _left_after(service, GRACE_S + 5)
    finally:
        up.stop()


MAX_TOKENS = 24
NO_HANG_S = 90.0


def test_a_killed_embedded_redis_comes_back_as_the_same_server_and_no_token_is_lost(
    one_gateway,
):
    """kill -9 of the embedded redis-server while four requests stream: the
    launcher starts it again on the same port, password and folder (its AOF),
    every stream completes with each seq exactly once, and new requests are
    served. Then killed again with its port taken meanwhile: a clear line,
    and the service stops (no restart loop), its folder removed."""
    up, port = one_gateway
    launcher = up.process
    url = f"ws://127.0.0.1:{port}/ws"
    [redis_port] = [int(m["port"]) for line in up.output if (m := REDIS_LINE.search(line))]
    old_pid, data_dir = _embedded_redis(launcher.pid)
    conf = dict(line.split(" ", 1) for line in (data_dir / "redis.conf").read_text().splitlines())

    async def disturbed() -> tuple[dict[str, Stream], float]:
        async with connect(url) as socket_:
            streams = await send_requests(socket_, MAX_TOKENS)
            await read_into(socket_, streams, time.monotonic() + 120, each_has_tokens(4))
            killed_at_s = time.monotonic()
            os.kill(old_pid, signal.SIGKILL)
            await read_into(socket_, streams, time.monotonic() + NO_HANG_S)
        return streams, killed_at_s

    streams, killed_at_s = asyncio.run(disturbed())
    assert_exactly_once(streams, MAX_TOKENS)
    for stream in streams.values():  # each spans the outage
        assert stream.token_times_s[0] < killed_at_s < stream.token_times_s[-1], stream
    assert launcher.poll() is None
    assert _restarts(up.drain()) == [("redis-server", -9)]
    # The same server: a new process on the same port, password and folder,
    # holding what was written before the kill (the requests' logs).
    new_pid, new_data_dir = _embedded_redis(launcher.pid)
    assert new_pid != old_pid and new_data_dir == data_dir
    client = redis.Redis(port=redis_port, password=conf["requirepass"], socket_timeout=5)
    assert client.info("server")["process_id"] == new_pid
    assert client.config_get("dir") == {"dir": str(data_dir)}
    keys = RedisKeys(redis_settings().prefix)
    for stream in streams.values():
        assert client.exists(keys.request_log(stream.request_id)), stream.request_id
    client.close()
    assert_exactly_once(asyncio.run(run_requests(url, 4)), 4)
    print(
        f"\nembedded redis kill -9: {len(streams)}/{len(streams)} streams completed exactly "
        f"once; longest pause {longest_gap_s(streams):.2f} s; all ended "
        f"{seconds_to_last_token(streams, killed_at_s):.2f} s after the kill"
    )

    # Killed again, its port taken before the launcher can start it again.
    children = [pid for pid, _ in descendants(launcher.pid)]
    os.kill(new_pid, signal.SIGKILL)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline_s = time.monotonic() + 5
        while True:
            try:
                squatter.bind(("127.0.0.1", redis_port))
                break
            except OSError:
                assert time.monotonic() < deadline_s, "the killed redis-server kept its port"
                time.sleep(0.01)
        squatter.listen(1)
        refused = re.compile(rf"cannot come back: port {redis_port} was taken by another process")
        _wait_line(up, refused, timeout_s=30)
    assert launcher.wait(timeout=60) == 1
    assert _restarts(up.drain()) == [("redis-server", -9), ("redis-server", -9)]
    assert not data_dir.exists()
    assert not any(process_start_ticks(pid) for pid in children)  # each gone (or a zombie)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_ctrl_c_or_a_closed_terminal_stops_in_order_and_removes_the_data_folder(
    prepared_model_dir, signum
):
    """Ctrl-C (SIGINT) and a closed terminal (SIGHUP) stop like SIGTERM: every
    child stopped, exit 0, and the folder holding the password and the AOF gone."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = UpProcess(["--port", str(free_port()), "--model", str(prepared_model_dir)], env)
    try:
        _wait_line(up, REDIS_LINE, timeout_s=60)
        _, data_dir = _embedded_redis(up.process.pid)
        assert (data_dir / "redis.conf").is_file()
        up.process.send_signal(signum)
        assert up.process.wait(timeout=60) == 0
        assert not data_dir.exists()
        assert "stopped." in [line.strip() for line in up.drain()]
    finally:
        up.stop()
