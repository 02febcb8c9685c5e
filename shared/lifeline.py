"""An actor's lifeline to the launcher that started it (``orcapod up``).

The launcher holds the write end of one pipe for as long as it lives and hands
each child the read end (``ORCAPOD_LIFELINE_FD``); nothing is ever written.
When the launcher is gone, however it went (SIGKILL, a supervisor's SIGTERM to
its process group and SIGKILL two seconds later, a crash), the kernel closes
its end and the read returns end-of-file. The actor then stops as on SIGTERM,
and if it has not ended ``GRACE_S`` later (a worker still compiling at start
does not look at its stop event), it exits at once. ``PR_SET_PDEATHSIG``
alone missed two cases: a child forked in the moment the launcher died, and
a child that takes the signal but is busy elsewhere.

An actor started any other way (by hand, by compose, by systemd) has no
lifeline and is not watched.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import structlog

LIFELINE_FD_ENV = "ORCAPOD_LIFELINE_FD"
# How long an actor whose launcher is gone may take to stop on its own.
GRACE_S = 5.0

_log = structlog.get_logger(__name__)


def watch_lifeline(program: str, grace_s: float = GRACE_S) -> threading.Thread | None:
    """Start watching the lifeline the environment names, if any; the watching
    thread (a daemon: it ends with the process), or None when there is none."""
    raw = os.environ.get(LIFELINE_FD_ENV)
    if not raw:
        return None
    try:
        fd = int(raw)
        os.fstat(fd)
    except (ValueError, OSError):
        _log.warning("lifeline_unusable", program=program, value=raw)
        return None
    thread = threading.Thread(
        target=_stop_when_cut, args=(fd, program, grace_s), name="lifeline", daemon=True
    )
    thread.start()
    return thread


def _stop_when_cut(fd: int, program: str, grace_s: float) -> None:
    while True:
        try:
            if not os.read(fd, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    _log.warning("launcher_gone", program=program, stopping_within_s=grace_s)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    _log.error("launcher_gone_exit", program=program, after_s=grace_s)
    os._exit(1)
