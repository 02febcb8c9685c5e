"""``python -m orcapod up`` as a child of a test: its output read by a thread
(so a test can wait for a line without blocking on the pipe), ready once it
says so, stopped with SIGTERM (then SIGKILL)."""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest

REPO = Path(__file__).resolve().parents[1]
READY_LINE = "orcapod is ready"


class UpProcess:
    """One ``orcapod up ARGS``; ``output`` holds every line read so far."""

    def __init__(
        self, args: Sequence[str], env: Mapping[str, str], own_group: bool = False
    ) -> None:
        """``own_group``: in a session (so a process group) of its own, as a
        supervisor starts a service, so a test may signal the whole group."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "orcapod", "up", *args],
            cwd=REPO,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=own_group,
        )
        self.output: list[str] = []
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        stdout = self.process.stdout
        assert stdout is not None
        self._reader = threading.Thread(target=self._read_lines, args=(stdout,), daemon=True)
        self._reader.start()

    def _read_lines(self, stdout: IO[str]) -> None:
        """The reader thread: every line the process prints, until it closes stdout."""
        for line in stdout:
            self._lines.put(line)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Return once it printed that it is ready; fail the test (and kill it) if
        it exits or takes longer."""
        self.wait_for(READY_LINE, "become ready", timeout_s)

    def wait_for(self, text: str, what: str, timeout_s: float) -> None:
        """Return once a line holding ``text`` was printed; fail the test (and kill
        it) if it exits or takes longer (``what``: what it did not do)."""
        deadline_s = time.monotonic() + timeout_s
        while not any(text in line for line in self.output):
            if time.monotonic() > deadline_s or self.process.poll() is not None:
                self.drain()
                self.process.kill()
                pytest.fail(f"orcapod up did not {what}:\n" + "".join(self.output[-40:]))
            with contextlib.suppress(queue.Empty):
                self.output.append(self._lines.get(timeout=1))

    def drain(self) -> list[str]:
        """Every line printed so far."""
        while True:
            try:
                self.output.append(self._lines.get_nowait())
            except queue.Empty:
                return self.output

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM, then SIGKILL if it is still there after ``timeout_s``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=5)
