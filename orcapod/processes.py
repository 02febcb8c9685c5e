"""Child processes of ``orcapod up``: start them, restart them, stop them in order.

Each child gets ``PR_SET_PDEATHSIG`` (Linux) and the read end of the
launcher's lifeline (``shared/lifeline.py``), so even if the launcher itself
is killed with SIGKILL, no actor is left running as an orphan: one forked as
the launcher died ends at once, and an actor that takes the signal but does
not stop (a worker compiling at start) ends a few seconds later. A child that
exits on its own is started again under the same name with backoff
(``RestartPolicy``); one that keeps exiting is a ``CrashLoopError``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

from shared.lifeline import LIFELINE_FD_ENV
from shared.parent_death import die_with_parent


class _Lifeline:
    """The launcher's end of the lifeline: a pipe whose write end this process
    holds until it dies (nothing is written); children get the read end."""

    def __init__(self) -> None:
        self._read_fd: int | None = None
        self._write_fd: int | None = None  # kept open, never written: closed by our death

    def read_fd(self) -> int:
        if self._read_fd is None:
            # Both ends non-inheritable (PEP 446): a child gets the read end
            # through pass_fds only, and no child ever holds the write end.
            self._read_fd, self._write_fd = os.pipe()
        return self._read_fd


_LIFELINE = _Lifeline()


@dataclass
class Child:
    """One started actor (or the embedded redis-server); ``restart_child``
    replaces its process, so every list holding it sees the new one."""

    name: str
    process: subprocess.Popen[bytes]
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    started_s: float = 0.0  # time.monotonic() at its (last) start

    @property
    def pid(self) -> int:
        return self.process.pid


def _spawn(argv: list[str], env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    lifeline_fd = _LIFELINE.read_fd()
    child_env = {**(os.environ if env is None else env), LIFELINE_FD_ENV: str(lifeline_fd)}
    return subprocess.Popen(
        argv,
        env=child_env,
        pass_fds=(lifeline_fd,),
        preexec_fn=partial(die_with_parent, signal.SIGTERM, os.getpid())
        if sys.platform == "linux"
        else None,
        # Its own process group: Ctrl-C in the terminal reaches only the launcher,
        # which stops the children in order (a gateway drains while workers run).
        process_group=0,
    )


def start_child(name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Child:
    """Start ``argv`` with this process's stdout/stderr, dying with this process."""
    child_env = dict(env) if env is not None else None
    return Child(
        name=name,
        process=_spawn(argv, child_env),
        argv=argv,
        env=child_env,
        started_s=time.monotonic(),
    )


def restart_child(child: Child) -> None:
    """Start ``child``'s command again (it has exited), under the same name."""
    assert child.process.poll() is not None, f"{child.name} is still running"
    child.process = _spawn(child.argv, child.env)
    child.started_s = time.monotonic()


class CrashLoopError(RuntimeError):
    """A child exited again and again: restarting it does not help."""


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited is started again.

    The delay doubles from ``first_delay_s`` up to ``max_delay_s``, and starts
    over once the child had run ``reset_after_s``. More than ``max_restarts``
    restarts of one child within ``window_s`` is a crash loop: the service
    stops (with the defaults, a child that dies at once stops the service at
    its 6th exit, about 16 s after the first).
    """

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    reset_after_s: float = 60.0
    max_restarts: int = 5
    window_s: float = 60.0


class RestartBackoff:
    """One child's restart history under a ``RestartPolicy`` (pure: times are given)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._delay_s = policy.first_delay_s
        self._restarts_s: deque[float] = deque()

    def next_delay_s(self, now_s: float, ran_s: float) -> float:
        """The child exited at ``now_s`` after running ``ran_s``: how long to wait
        before starting it again; raises CrashLoopError past ``max_restarts``."""
        policy = self.policy
        if ran_s >= policy.reset_after_s:
            self._delay_s = policy.first_delay_s
        while self._restarts_s and now_s - self._restarts_s[0] > policy.window_s:
            self._restarts_s.popleft()
        if len(self._restarts_s) >= policy.max_restarts:
            raise CrashLoopError(
                f"it was restarted {len(self._restarts_s)} times within {policy.window_s:g} s"
            )
        self._restarts_s.append(now_s)
        delay_s = self._delay_s
        self._delay_s = min(delay_s * 2, policy.max_delay_s)
        return delay_s


def restart_exited(
    children: list[Child],
    backoffs: dict[str, RestartBackoff],
    restart_at_s: dict[str, float],
    restart: Callable[[Child], None] = restart_child,
) -> None:
    """Schedule a restart of each child that exited (one line each) and start
    those whose delay is over with ``restart``; raises CrashLoopError (naming
    the child) for a child that keeps exiting, and whatever ``restart`` raises."""
    now_s = time.monotonic()
    for child in children:
        due_s = restart_at_s.get(child.name)
        if due_s is not None:
            if now_s >= due_s:
                del restart_at_s[child.name]
                restart(child)
            continue
        if child.process.poll() is None:
            continue
        try:
            delay_s = backoffs[child.name].next_delay_s(now_s, now_s - child.started_s)
        except CrashLoopError as error:
            raise CrashLoopError(f"{child.name} keeps exiting: {error}") from error
        restart_at_s[child.name] = now_s + delay_s
        print(
            f"orcapod up: {child.name} exited with code {child.process.returncode}; "
            f"restarting it in {delay_s:g} s",
            file=sys.stderr,
            flush=True,
        )


def python_module(module: str, *args: str) -> list[str]:
    """The command line ``python -m module args``: what ``ps`` shows for an actor."""
    return [sys.executable, "-m", module, *args]


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
