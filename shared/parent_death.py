"""A child process that dies with its parent, however the parent goes (kill -9
included): Linux's ``PR_SET_PDEATHSIG``. Elsewhere nothing is set, and the
parent's own shutdown has to stop its children."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(signal_number: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """Have the kernel send ``signal_number`` to this process when its parent ends.

    Given ``parent_pid`` (the parent's pid before the fork), a parent that died
    before the call (no signal will come then) ends this process at once."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal_number)
    except (OSError, AttributeError):
        return  # not Linux
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
