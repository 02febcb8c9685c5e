"""Child processes of ``orcapod up``: start them, watch them, stop them in order.

Each child gets ``PR_SET_PDEATHSIG`` (Linux), so even if the launcher itself
is killed with SIGKILL, no actor is left running as an orphan.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the launcher's own shutdown still stops its children


@dataclass
class Child:
    """One started actor (or the embedded redis-server)."""

    name: str
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid


def start_child(name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Child:
    """Start ``argv`` with this process's stdout/stderr, dying with this process."""
    process = subprocess.Popen(
        argv,
        env=dict(env) if env is not None else None,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        # Its own process group: Ctrl-C in the terminal reaches only the launcher,
        # which stops the children in order (a gateway drains while workers run).
        process_group=0,
    )
    return Child(name=name, process=process)


def python_module(module: str, *args: str) -> list[str]:
    """The command line ``python -m module args``: what ``ps`` shows for an actor."""
    return [sys.executable, "-m", module, *args]


def first_exited(children: list[Child]) -> Child | None:
    """A child that has exited, if any."""
    return next((child for child in children if child.process.poll() is not None), None)


def stop_children(children: list[Child], timeout_s: float = 15.0) -> None:
    """SIGTERM each child in the given order, waiting for each; SIGKILL stragglers.

    Order matters: gateways first (stop accepting), then workers, then the
    scheduler, then Redis, so nobody loses its Redis while draining.
    """
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while child.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()


def stop_together(children: list[Child], timeout_s: float) -> None:
    """SIGTERM every child at once, wait up to ``timeout_s`` for all; SIGKILL stragglers.

    For peers that drain in parallel (gateways finishing their requests).
    """
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(child.process.poll() is None for child in children):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for child in children:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()


def environment_with(**values: str) -> dict[str, str]:
    """This process's environment plus ``values`` (secrets go here, never on a command line)."""
    env = dict(os.environ)
    env.update(values)
    return env
