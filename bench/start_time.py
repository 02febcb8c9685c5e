"""How soon ``orcapod up`` answers after it starts: an empty cache folder, then a restart.

    python -m bench.start_time [--restarts 2] [--out FILE.json] [-- UP ARGS...]

A fresh cache folder (``ORCAPOD_CACHE_DIR``) holds only the prepared model
(linked from the usual cache folder, as ``orcapod model prepare`` would
leave it) and the project's built kernels (as ``scripts/setup.sh`` leaves
them). ``orcapod up`` starts on it with its embedded Redis; the benchmark
asks for a short chat answer every half second until one comes back, and
records when (seconds after the launcher started), then reads the worker's
log for when each compiled path went live. Then it stops the service and
starts it again ``--restarts`` times on the same, now warm, folder.

Prints a table and writes JSON (``--out``, default
``bench/results/start_time.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.machine import lscpu_machine
from bench.output import RESULTS_DIR, write_json
from orcapod.embedded_redis import free_loopback_port
from shared.settings import model_location

# Longer than a first compile of every graph on two slow cores.
GIVE_UP_S = 900.0
QUESTION = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def answer_once(port: int) -> bool:
    """True once the chat endpoint gives an answer (any refusal or no listener: False)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(QUESTION).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return bool(json.load(response)["choices"][0]["message"]["content"] is not None)
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return False


def fresh_cache_folder(root: Path) -> Path:
    """A cache folder with the prepared models and built kernels, nothing compiled."""
    source = model_location(
        environ={k: v for k, v in os.environ.items() if k != "ORCAPOD_MODEL"}
    ).cache_dir
    folder = root / "cache"
    folder.mkdir()
    (folder / "models").symlink_to(source / "models")
    if (source / "extensions").exists():
        shutil.copytree(source / "extensions", folder / "extensions", symlinks=True)
    return folder


def live_paths(log_text: str) -> dict[str, float]:
    """Seconds after the engine was built at which each path went live (the
    worker's ``step_path_live`` lines)."""
    found: dict[str, float] = {}
    for line in log_text.splitlines():
        if '"step_path_live"' not in line:
            continue
        with contextlib.suppress(ValueError, KeyError):
            record = json.loads(line)
            found[record["path"]] = float(record["after_start_s"])
    return found


def one_start(cache_dir: Path, up_args: list[str], log_path: Path) -> dict[str, Any]:
    """Start ``orcapod up`` on ``cache_dir``, wait for its first answer, stop it."""
    port = free_loopback_port()
    environment = {**os.environ, "ORCAPOD_CACHE_DIR": str(cache_dir)}
    environment.pop("REDIS_URL", None)
    argv = [sys.executable, "-m", "orcapod", "up", "--port", str(port), *up_args]
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while not answer_once(port):
                if process.poll() is not None:
                    raise RuntimeError(f"orcapod up exited; see {log_path}")
                if time.monotonic() - started > GIVE_UP_S:
                    raise RuntimeError(f"no answer in {GIVE_UP_S} s; see {log_path}")
                time.sleep(0.5)
            first_answer_s = time.monotonic() - started
            # Let the background compiles finish, to see when each path went live.
            settled = _wait_for_line(log_path, "step_paths_settled", started + GIVE_UP_S)
            settled_s = time.monotonic() - started if settled else None
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
    return {
        "first_answer_s": round(first_answer_s, 1),
        "all_paths_live_s": None if settled_s is None else round(settled_s, 1),
        "paths_live_after_worker_start_s": live_paths(log_path.read_text(errors="replace")),
    }


def _wait_for_line(log_path: Path, marker: str, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if marker in log_path.read_text(errors="replace"):
            return True
        time.sleep(0.5)
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=2, help="starts on the warm folder")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "start_time.json")
    parser.add_argument("--logs", type=Path, help="keep each start's log in this folder")
    parser.add_argument("up_args", nargs="*", help="after --: arguments for orcapod up")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="orcapod-start-") as root:
        cache_dir = fresh_cache_folder(Path(root))
        for index in range(1 + args.restarts):
            kind = "empty cache folder" if index == 0 else "warm cache folder"
            log_path = (args.logs or Path(root)) / f"up-{index}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            result = {"start": kind, **one_start(cache_dir, args.up_args, log_path)}
            runs.append(result)
            print(f"{kind:20} first answer {result['first_answer_s']:6.1f} s, "
                  f"every path live {result['all_paths_live_s']} s")  # fmt: skip
    print()
    print("| start | first answer s | every compiled path live s |")
    print("|---|---:|---:|")
    for run in runs:
        print(f"| {run['start']} | {run['first_answer_s']} | {run['all_paths_live_s']} |")
    write_json(args.out, {"machine": lscpu_machine(), "up_args": args.up_args, "runs": runs})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
