"""The embedded redis-server's data folder and its restart: which folders the
sweep removes (fake folders naming real live, dead and zombie processes, and
a real launcher killed with SIGKILL), and a redis-server killed with SIGKILL
brought back as the same server, or refused when its port was taken."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from orcapod.embedded_redis import (
    LAUNCHER_FILE,
    UNMARKED_GRACE_S,
    EmbeddedRedis,
    EmbeddedRedisError,
    Launcher,
    is_stale,
    parse_launcher,
    process_start_ticks,
    remove_data,
    remove_stale_data_dirs,
    restart_embedded_redis,
    start_embedded_redis,
    this_launcher,
)
from orcapod.processes import stop_children

ROOT = Path(__file__).resolve().parents[1]


# --- the rule -----------------------------------------------------------------------------

ALIVE = Launcher(boot_id="b", pid_namespace="pid:[1]", pid=10, start_ticks=5)


@pytest.mark.parametrize(
    ("recorded", "running", "in_use", "age_s", "stale"),
    [
        (ALIVE, True, False, 1e6, False),  # its launcher runs: never, however old
        (ALIVE, False, False, 0.0, True),  # its launcher is gone: at once
        (ALIVE, False, True, 1e6, False),  # a process (its redis-server) works in it
        (None, False, False, UNMARKED_GRACE_S - 1, False),  # maybe being created
        (None, False, False, UNMARKED_GRACE_S + 1, True),  # made before launcher files
        (None, False, True, 1e6, False),
    ],
)
def test_a_folder_is_stale_only_when_nobody_can_be_using_it(
    recorded: Launcher | None, running: bool, in_use: bool, age_s: float, stale: bool
) -> None:
    assert is_stale(recorded, running, in_use, age_s) is stale


def test_a_launcher_file_round_trips_and_anything_else_names_no_launcher() -> None:
    launcher = Launcher("0e1f-aa", "pid:[4026531836]", 4242, 987654)
    assert parse_launcher(launcher.to_text()) == launcher
    no_namespace = "boot_id=x\npid=4\nstart_ticks=3\n"
    negative = "boot_id=x\npid_namespace=pid:[1]\npid=-1\nstart_ticks=3\n"
    for text in (
        "",
        "pid=4242\n",
        no_namespace,
        negative,
        launcher.to_text().rpartition("start_ticks")[0],
    ):
        assert parse_launcher(text) is None, text


# --- processes as /proc sees them ---------------------------------------------------------


def _exited_process_with_ticks() -> tuple[int, int]:
    """A pid whose process ran (its start ticks read while it did) and is gone."""
    process = subprocess.Popen(["sleep", "30"])
    ticks = process_start_ticks(process.pid)
    assert ticks is not None
    process.kill()
    process.wait()
    return process.pid, ticks


def test_start_ticks_name_a_running_process_and_not_a_dead_or_zombie_one() -> None:
    me = this_launcher()
    assert me is not None and me.pid == os.getpid()
    assert process_start_ticks(os.getpid()) == me.start_ticks
    pid, _ = _exited_process_with_ticks()
    assert process_start_ticks(pid) is None
    zombie = subprocess.Popen(["true"])
    deadline_s = time.monotonic() + 10
    while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline_s, "it never exited"
        time.sleep(0.01)
    assert process_start_ticks(zombie.pid) is None  # exited, not reaped: can do nothing
    zombie.wait()


# --- the sweep ----------------------------------------------------------------------------


def _folder(parent: Path, name: str, launcher_text: str | None, age_s: float = 0.0) -> Path:
    folder = parent / f"orcapod-redis-{name}"
    folder.mkdir()
    (folder / "redis.conf").write_text("requirepass secret\n")
    if launcher_text is not None:
        (folder / LAUNCHER_FILE).write_text(launcher_text)
    stamp_s = time.time() - age_s
    os.utime(folder, (stamp_s, stamp_s))
    return folder


def test_the_sweep_removes_the_folders_of_gone_launchers_and_nothing_else(tmp_path: Path) -> None:
    me = this_launcher()
    assert me is not None
    dead_pid, dead_ticks = _exited_process_with_ticks()
    old_s = UNMARKED_GRACE_S + 60
    dead = _folder(
        tmp_path, "dead", replace(me, pid=dead_pid, start_ticks=dead_ticks).to_text(), age_s=old_s
    )
    # Its pid now belongs to another process (this one): a different start time.
    reused = _folder(tmp_path, "reused", replace(me, start_ticks=me.start_ticks + 1).to_text())
    other_boot = _folder(tmp_path, "boot", replace(me, boot_id="another-boot").to_text())
    unmarked_old = _folder(tmp_path, "unmarked", None, age_s=old_s)
    cut_short = _folder(tmp_path, "cut", "boot_id=", age_s=old_s)
    alive = _folder(tmp_path, "alive", me.to_text(), age_s=old_s)
    # A launcher in another pid namespace (a container sharing /tmp): its pid
    # cannot be looked up from here, so its folder stays.
    elsewhere_launcher = replace(me, pid_namespace="pid:[1]", pid=dead_pid, start_ticks=dead_ticks)
    other_namespace = _folder(tmp_path, "namespace", elsewhere_launcher.to_text(), age_s=old_s)
    unmarked_new = _folder(tmp_path, "new", None)
    worked_in = _folder(tmp_path, "worked", None, age_s=old_s)
    dead_worked_in = _folder(
        tmp_path, "deadworked", replace(me, pid=dead_pid, start_ticks=dead_ticks).to_text()
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "orcapod-redis-link").symlink_to(elsewhere)
    (tmp_path / "orcapod-redis-file").write_text("not a folder")
    # A redis-server works in its folder: live processes doing the same (one in
    # a subfolder, one in the parent, which protects nothing).
    (dead_worked_in / "appendonlydir").mkdir()
    workers = [
        subprocess.Popen(["sleep", "60"], cwd=worked_in),
        subprocess.Popen(["sleep", "60"], cwd=dead_worked_in / "appendonlydir"),
        subprocess.Popen(["sleep", "60"], cwd=tmp_path),
    ]
    try:
        removed = remove_stale_data_dirs(tmp_path)
    finally:
        for process in workers:
            process.kill()
            process.wait()
    gone = {dead, reused, other_boot, unmarked_old, cut_short}
    assert set(removed) == gone
    assert not any(folder.exists() for folder in gone)
    for kept in (alive, other_namespace, unmarked_new, worked_in, dead_worked_in):
        assert (kept / "redis.conf").is_file(), kept
    assert elsewhere.is_dir() and (tmp_path / "orcapod-redis-link").is_symlink()
    assert (tmp_path / "orcapod-redis-file").is_file()
    # Once nobody works in them, they go too.
    assert remove_stale_data_dirs(tmp_path) == [dead_worked_in, worked_in]


_LAUNCHER = """
import sys, time
from orcapod.embedded_redis import start_embedded_redis
embedded = start_embedded_redis()
print(embedded.data_dir, embedded.child.pid, flush=True)
time.sleep(120)
"""


def test_the_folder_of_a_launcher_killed_with_sigkill_is_removed_by_the_next_sweep(
    tmp_path: Path,
) -> None:
    """A real launcher (a process that started an embedded redis-server), alive
    then killed: its folder stays while it runs, goes at the next sweep."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout is not None
        data_dir_text, redis_pid_text = launcher.stdout.readline().split()
        data_dir, redis_pid = Path(data_dir_text), int(redis_pid_text)
        assert data_dir.parent == tmp_path
        assert remove_stale_data_dirs(tmp_path) == []  # its launcher runs
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        # Its redis-server follows it (PR_SET_PDEATHSIG), working in the folder until then.
        deadline_s = time.monotonic() + 10
        while process_start_ticks(redis_pid) is not None:
            assert time.monotonic() < deadline_s, "redis-server outlived its launcher"
            time.sleep(0.05)
        assert data_dir.is_dir()  # nobody cleaned up
        assert remove_stale_data_dirs(tmp_path) == [data_dir]
        assert not data_dir.exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_a_redis_server_that_cannot_start_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(EmbeddedRedisError, match="did not start"):
        start_embedded_redis(timeout_s=5.0, maxmemory="plenty")  # redis-server refuses it
    assert list(tmp_path.iterdir()) == []


# --- the restart --------------------------------------------------------------------------


def _kill_redis(embedded: EmbeddedRedis) -> None:
    embedded.child.process.send_signal(signal.SIGKILL)
    embedded.child.process.wait()


def test_a_killed_redis_server_comes_back_as_the_same_server_unless_its_port_was_taken() -> None:
    embedded = start_embedded_redis()
    try:
        client = redis.Redis.from_url(embedded.url)
        client.xadd("orcapod-test:log", {"seq": 0})
        first_pid = embedded.child.pid
        _kill_redis(embedded)
        restart_embedded_redis(embedded)
        assert embedded.child.pid != first_pid
        deadline_s = time.monotonic() + 10
        while True:
            try:
                # The same URL (port, password) reaches it, and it reloaded its AOF.
                assert client.xlen("orcapod-test:log") == 1
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline_s, "it did not come back"
                time.sleep(0.05)
        assert client.info("server")["process_id"] == embedded.child.pid
        assert client.config_get("dir") == {"dir": str(embedded.data_dir)}
        client.close()

        _kill_redis(embedded)
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis does
            squatter.bind(("127.0.0.1", embedded.port))
            squatter.listen(1)
            with pytest.raises(EmbeddedRedisError, match=f"port {embedded.port} was taken"):
                restart_embedded_redis(embedded)
        assert embedded.child.process.poll() is not None  # not started into a bind error
    finally:
        stop_children([embedded.child])
        remove_data(embedded)
