"""The redis-server ``orcapod up`` starts when ``REDIS_URL`` is not set, and its data folder.

It listens on a free loopback port, keeps its data in a temporary folder
(``orcapod-redis-*``), and requires a random password, so nothing else on the
machine can use it by accident. Its memory is capped (``maxmemory``, default
512 MB) with the ``noeviction`` policy: a full Redis refuses writes ("OOM
command not allowed"), which every actor retries with backoff, rather than
dropping keys (a request log, a pending submit) that the service's durability
rests on.

Everything that defines it (port, password, folder) lives in the folder's
``redis.conf``, so ``restart_embedded_redis`` brings a dead one back as the
same server, reloading its append-only file. The folder holds the password
and every request's log: its launcher removes it on the way out
(``remove_data``), and names itself in it (``Launcher``), so that a later
start can remove the folder of a launcher killed before it could
(``remove_stale_data_dirs``).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from orcapod.processes import Child, restart_child, start_child

DEFAULT_MAXMEMORY = "512mb"
DATA_DIR_PREFIX = "orcapod-redis-"
LAUNCHER_FILE = "launcher"
# A folder with no (readable) launcher file is left alone this long: its
# launcher may be between creating it and writing the file. Folders made
# before launcher files existed are older than that.
UNMARKED_GRACE_S = 60.0

INSTALL_HINT = (
    "redis-server is not installed. Install it (Debian/Ubuntu: sudo apt-get install "
    "redis-server; macOS: brew install redis) or point REDIS_URL at a running Redis."
)


class EmbeddedRedisError(RuntimeError):
    """redis-server is missing, did not start, or cannot be started again."""


@dataclass
class EmbeddedRedis:
    """A running redis-server child, the URL to reach it, and its data folder."""

    child: Child
    url: str
    port: int
    data_dir: Path


# --- who made a data folder ----------------------------------------------------------


@dataclass(frozen=True)
class Launcher:
    """The process that made a data folder, told apart from any later process
    with the same pid by its start time (and the boot both were in); its pid
    means something only in its pid namespace (a container's, say)."""

    boot_id: str
    pid_namespace: str  # /proc/self/ns/pid's link, like "pid:[4026531836]"
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: clock ticks from boot to its start

    def to_text(self) -> str:
        """The launcher file's content."""
        return (
            f"boot_id={self.boot_id}\npid_namespace={self.pid_namespace}\n"
            f"pid={self.pid}\nstart_ticks={self.start_ticks}\n"
        )


def parse_launcher(text: str) -> Launcher | None:
    """The launcher a file names; None for anything else (a file cut short, say)."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        fields[key] = value
    boot_id, namespace, pid, start_ticks = (
        fields.get(key, "") for key in ("boot_id", "pid_namespace", "pid", "start_ticks")
    )
    if not boot_id or not namespace or not pid.isdigit() or not start_ticks.isdigit():
        return None
    if int(pid) <= 0:
        return None
    return Launcher(boot_id, namespace, int(pid), int(start_ticks))


def is_stale(recorded: Launcher | None, launcher_running: bool, in_use: bool, age_s: float) -> bool:
    """Whether a data folder may be removed: no process works in it, and the
    launcher it names is gone (or it names none and is older than the grace)."""
    if in_use:
        return False
    if recorded is None:
        return age_s > UNMARKED_GRACE_S
    return not launcher_running


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks from boot); None if there is
    no such process, or only its zombie (it can do nothing any more)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # Fields 3.. follow the command name, which may itself hold spaces and ")".
    fields = text.rpartition(")")[2].split()
    if len(fields) < 20 or fields[0] == "Z" or not fields[19].isdigit():
        return None
    return int(fields[19])


def this_launcher() -> Launcher | None:
    """This process as a launcher; None where /proc cannot tell (not Linux)."""
    boot_id, namespace = _boot_id(), _pid_namespace()
    start_ticks = process_start_ticks(os.getpid())
    if not boot_id or not namespace or start_ticks is None:
        return None
    return Launcher(boot_id, namespace, os.getpid(), start_ticks)


def launcher_running(recorded: Launcher, current: Launcher) -> bool:
    """Whether the process a launcher file names may still run (``current``:
    this process): not if the machine rebooted since or its pid now names
    another process; yes when its pid is another namespace's, which this one
    cannot look at."""
    if recorded.boot_id != current.boot_id:
        return False
    if recorded.pid_namespace != current.pid_namespace:
        return True
    return process_start_ticks(recorded.pid) == recorded.start_ticks


def _working_directories() -> list[Path]:
    """The working directory of every process this user may look at: a
    redis-server works in its data folder (``dir``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append(Path(os.readlink(entry / "cwd")))
            except OSError:
                continue  # gone meanwhile, or another user's
    return found


def remove_stale_data_dirs(temp_dir: Path | None = None) -> list[Path]:
    """Remove this user's data folders (``orcapod-redis-*`` in ``temp_dir``,
    default the temporary directory) that ``is_stale``; the folders removed.

    A folder some process works in, or whose launcher still runs, is never
    removed. Off Linux, where /proc cannot tell, nothing is removed.
    """
    current = this_launcher()
    if current is None:
        return []
    # Resolved: the working directories it is compared with are.
    parent = (temp_dir if temp_dir is not None else Path(tempfile.gettempdir())).resolve()
    cwds = _working_directories()
    removed = []
    for folder in sorted(parent.glob(DATA_DIR_PREFIX + "*")):
        try:
            info = folder.lstat()
        except OSError:
            continue
        # Only real folders of this user: never a link someone else planted.
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        try:
            recorded = parse_launcher((folder / LAUNCHER_FILE).read_text(encoding="ascii"))
        except (OSError, UnicodeDecodeError):
            recorded = None
        running = recorded is not None and launcher_running(recorded, current)
        in_use = any(cwd == folder or folder in cwd.parents for cwd in cwds)
        if is_stale(recorded, running, in_use, age_s=time.time() - info.st_mtime):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append(folder)
    return removed


# --- the server ----------------------------------------------------------------------


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_is_taken(port: int) -> bool:
    """Whether another process listens on 127.0.0.1:``port``: the bind redis-server
    would do (address reuse on, so its own closed connections do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen(1)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def _wait_listening(child: Child, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError as error:
            if child.process.poll() is not None or time.monotonic() > deadline:
                child.process.kill()
                child.process.wait()
                raise EmbeddedRedisError(f"redis-server did not start on port {port}") from error
            time.sleep(0.05)


def start_embedded_redis(
    timeout_s: float = 10.0, maxmemory: str = DEFAULT_MAXMEMORY
) -> EmbeddedRedis:
    """Start redis-server (capped at ``maxmemory``, a redis size like "512mb")
    in a new data folder naming this process, and wait until it accepts
    connections."""
    if not maxmemory.strip() or any(c.isspace() for c in maxmemory):
        raise EmbeddedRedisError(f"--redis-maxmemory {maxmemory!r} is not a size like 512mb")
    executable = shutil.which("redis-server")
    if executable is None:
        raise EmbeddedRedisError(INSTALL_HINT)
    port = free_loopback_port()
    password = secrets.token_hex(16)
    data_dir = Path(tempfile.mkdtemp(prefix=DATA_DIR_PREFIX))
    try:
        launcher = this_launcher()
        if launcher is not None:
            (data_dir / LAUNCHER_FILE).write_text(launcher.to_text(), encoding="ascii")
        config = data_dir / "redis.conf"
        # The password goes in a file, not on the command line, where ps would show it.
        config.write_text(
            f"port {port}\nbind 127.0.0.1\nrequirepass {password}\ndir {data_dir}\n"
            'appendonly yes\nsave ""\nprotected-mode yes\nloglevel warning\n'
            f"maxmemory {maxmemory}\nmaxmemory-policy noeviction\n"
            # Its own log file: its banner and notices would drown the service's output.
            f"logfile {data_dir / 'redis.log'}\n",
            encoding="utf-8",
        )
        config.chmod(0o600)
        child = start_child("redis-server", [executable, str(config)])
        _wait_listening(child, port, timeout_s)
    except BaseException:
        shutil.rmtree(data_dir, ignore_errors=True)
        raise
    return EmbeddedRedis(
        child=child, url=f"redis://:{password}@127.0.0.1:{port}/0", port=port, data_dir=data_dir
    )


def restart_embedded_redis(redis: EmbeddedRedis) -> None:
    """Start the exited redis-server again on the same port, password and data
    folder (it reloads its append-only file); raises EmbeddedRedisError when it
    cannot come back as the same server: its port taken, its folder gone."""
    if not (redis.data_dir / "redis.conf").is_file():
        raise EmbeddedRedisError(
            f"the embedded redis-server cannot come back: its data folder {redis.data_dir} is gone"
        )
    if port_is_taken(redis.port):
        raise EmbeddedRedisError(
            f"the embedded redis-server cannot come back: port {redis.port} was taken by "
            "another process meanwhile (every actor knows it by that port)"
        )
    restart_child(redis.child)


def remove_data(redis: EmbeddedRedis) -> None:
    """Delete the data folder once redis-server has stopped."""
    shutil.rmtree(redis.data_dir, ignore_errors=True)
