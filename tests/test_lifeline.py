"""Actors die with the launcher that started them, however it dies: real
processes, a launcher started as ``orcapod up`` starts its children
(``orcapod/processes.py``), actors run through ``run_actor``
(``shared/lifeline.py``).

The audit's orphans: a supervisor's SIGTERM to the launcher's process group,
then SIGKILL 2 s later, left a worker that ignored (or did not act on) its
SIGTERM running with parent 1, retrying a Redis that was gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shared.lifeline import GRACE_S, LIFELINE_FD_ENV, watch_lifeline

# An actor that takes no notice of SIGTERM (a worker compiling at start).
DEAF_ACTOR = textwrap.dedent(
    """
    import asyncio, signal, sys
    from shared.log import run_actor

    async def main():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        await asyncio.sleep(120)

    sys.exit(run_actor("deaf", main()))
    """
)
# An actor that stops on SIGTERM, as every actor does once it serves.
POLITE_ACTOR = textwrap.dedent(
    """
    import asyncio, sys
    from shared.log import run_actor, stop_on_signals

    async def main():
        stop = stop_on_signals()
        print("ready", flush=True)
        await asyncio.wait_for(stop.wait(), 120)

    sys.exit(run_actor("polite", main()))
    """
)
LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from orcapod.processes import start_child

    child = start_child("actor", [sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(120)
    """
)
REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's exit may wait for a reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _gone_within(pid: int, timeout_s: float) -> float | None:
    """Seconds until ``pid`` is gone, or None if it outlives ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if not _alive(pid):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def _launch(actor: str) -> tuple[subprocess.Popen[str], int]:
    """A launcher in a process group of its own and its one child, both started."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, actor],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        process_group=0,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert launcher.stdout is not None
    child_pid = int(launcher.stdout.readline())
    deadline = time.monotonic() + 30
    # The child prints "ready" to the launcher's stdout (inherited) once it runs.
    while launcher.stdout.readline().strip() != "ready":
        assert time.monotonic() < deadline, "the actor did not start"
    return launcher, child_pid


@pytest.mark.parametrize("actor", [DEAF_ACTOR, POLITE_ACTOR], ids=["deaf", "polite"])
def test_an_actor_ends_when_its_launcher_is_killed(actor: str) -> None:
    launcher, child_pid = _launch(actor)
    try:
        launcher.kill()
        launcher.wait()
        took_s = _gone_within(child_pid, GRACE_S + 5)
        assert took_s is not None, "the actor outlived its launcher"
        if actor is POLITE_ACTOR:
            assert took_s < GRACE_S  # it stopped on the signal, not at the deadline
    finally:
        if _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_supervisors_term_then_kill_of_the_group_leaves_no_actor() -> None:
    """SIGTERM to the launcher's process group (the children have groups of
    their own), SIGKILL 2 s later: what a supervisor does when a stop takes long."""
    launcher, child_pid = _launch(DEAF_ACTOR)
    try:
        os.killpg(launcher.pid, signal.SIGTERM)
        time.sleep(2)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert _gone_within(child_pid, GRACE_S + 5) is not None
    finally:
        if _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_an_actor_started_by_hand_or_with_a_bad_lifeline_is_not_watched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(LIFELINE_FD_ENV, raising=False)
    assert watch_lifeline("by hand") is None
    for bad in ("x", "-1", "99999", "1e3", " "):
        monkeypatch.setenv(LIFELINE_FD_ENV, bad)
        assert watch_lifeline("bad") is None
