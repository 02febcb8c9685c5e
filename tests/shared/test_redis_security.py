"""Redis behind a password, an ACL user and TLS, for real: every actor reaches Redis
through ``shared.redis_streams.connect(REDIS_URL)``, so these URL forms are all the
configuration there is (docs/security.md, "Redis: password, ACL user, TLS").

Each server is a real redis-server child; the TLS certificates (a CA, a server
certificate for 127.0.0.1 and a client certificate) are made here with the
``openssl`` command. The Debian redis-server is built with TLS: if a build
without it is installed, the TLS tests fail, they do not skip.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError

from orcapod.embedded_redis import remove_data, start_embedded_redis
from orcapod.processes import stop_children
from shared.messages import WorkerLeft, decode_control_message
from shared.redis_streams import connect, ensure_group, read_group, xadd_message
from tests.conftest import free_port
from tests.gpu_worker.tiny_models import write_tiny_model
from tests.shared.secured_redis import KEYS, PASSWORD, SecuredRedis, tls_query

ROOT = Path(__file__).resolve().parents[2]


# --- the stream helpers over each URL form --------------------------------------------


async def _round_trip(url: str) -> WorkerLeft:
    """XADD one wire Struct and read it back through a consumer group, as the actors do."""
    client = connect(url)
    try:
        await ensure_group(client, KEYS.control, "security-test")
        pipe = client.pipeline(transaction=False)
        xadd_message(pipe, KEYS.control, WorkerLeft(worker_id="w-secure"))
        await pipe.execute()
        entries = await read_group(
            client,
            "security-test",
            "reader",
            {KEYS.control: decode_control_message},
            KEYS.dead,
            block_ms=1000,
            count=10,
        )
        assert len(entries) == 1
        await client.xack(KEYS.control, "security-test", entries[0].entry_id)
        message = entries[0].message
        assert isinstance(message, WorkerLeft)
        return message
    finally:
        await client.aclose()


async def _ping(url: str) -> None:
    client = connect(url, socket_timeout_s=5.0)
    try:
        await client.ping()
    finally:
        await client.aclose()


def _refused(url: str, error: type[Exception], match: str) -> None:
    started_s = time.monotonic()
    with pytest.raises(error, match=match):
        asyncio.run(_ping(url))
    # A refused login is final: it is not retried like a lost connection.
    assert time.monotonic() - started_s < 2.0


def test_password_url_round_trips_and_refuses_wrong_or_no_password(password_redis):
    assert asyncio.run(_round_trip(password_redis.url)) == WorkerLeft(worker_id="w-secure")
    _refused(password_redis.wrong_password_url, AuthenticationError, "invalid username-password")
    _refused(password_redis.no_password_url, AuthenticationError, "Authentication required")


def test_acl_user_url_round_trips_under_the_prefix_and_nowhere_else(acl_redis):
    assert asyncio.run(_round_trip(acl_redis.url)) == WorkerLeft(worker_id="w-secure")
    _refused(acl_redis.wrong_password_url, AuthenticationError, "invalid username-password")
    _refused(acl_redis.no_password_url, AuthenticationError, "Authentication required")

    async def outside_the_prefix() -> None:
        client = connect(acl_redis.url)
        try:
            # The gateways' token channels are pub/sub channels under the prefix too.
            assert await client.publish(KEYS.tokens("gw"), b"x") == 0
            with pytest.raises(NoPermissionError):
                await client.set("elsewhere:key", b"1")
            with pytest.raises(NoPermissionError):
                await client.publish("elsewhere:channel", b"x")
        finally:
            await client.aclose()

    asyncio.run(outside_the_prefix())


def test_tls_url_round_trips_and_refuses_no_cert_untrusted_ca_and_wrong_password(
    tls_redis, certificates
):
    assert asyncio.run(_round_trip(tls_redis.url)) == WorkerLeft(worker_id="w-secure")
    _refused(tls_redis.wrong_password_url, AuthenticationError, "invalid username-password")
    address = tls_redis.url.split("@", 1)[1].split("?", 1)[0]
    secret = quote(PASSWORD, safe="")
    # Without a client certificate the server ends the handshake.
    no_cert = f"rediss://:{secret}@{address}?{tls_query(certificates, client_cert=False)}"
    with pytest.raises(ConnectionError):
        asyncio.run(_ping(no_cert))
    # Without our CA the client does not trust the server.
    untrusted = f"rediss://:{secret}@{address}?ssl_cert_reqs=required"
    with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(_ping(untrusted))


def test_this_redis_server_build_has_tls(tmp_path):
    """The TLS tests above need it: a build without TLS must show up as a failure."""
    version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert "v=" in version
    linked = subprocess.run(
        ["ldd", shutil.which("redis-server") or "redis-server"], capture_output=True, text=True
    ).stdout
    assert "libssl" in linked, f"redis-server ({version.strip()}) is built without TLS"


# --- the actors' command lines -----------------------------------------------------


def _start(module: str, *args: str, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=log, stderr=log
        )


@pytest.mark.parametrize("kind", ["password_redis", "acl_redis", "tls_redis"])
def test_every_actor_registers_through_redis_url(kind, request, tmp_path):
    """``REDIS_URL`` alone gets the three actors registered: the ready key appears
    only once the scheduler has read the worker's join, and the gateway (which
    listens only once its SUBSCRIBE is in place) reports it on /healthz. None
    logs the password."""
    secured: SecuredRedis = request.getfixturevalue(kind)
    model_dir = write_tiny_model(tmp_path / "tiny", "llama")
    env = {**os.environ, "REDIS_URL": secured.url}
    logs = {name: tmp_path / f"{name}.log" for name in ("scheduler", "worker", "gateway")}
    gateway_port = free_port()
    processes = {
        "scheduler": _start("scheduler_actor", env=env, log_path=logs["scheduler"]),
        "worker": _start(
            "gpu_worker",
            "--worker-id=w-secure",
            f"--model={model_dir}",
            "--device=cpu",
            "--dtype=float32",
            f"--kv-cache-bytes={4 << 20}",
            env=env,
            log_path=logs["worker"],
        ),
        "gateway": _start(
            "gateway",
            "--gateway-id=gw-secure",
            f"--port={gateway_port}",
            f"--model={model_dir}",
            env=env,
            log_path=logs["gateway"],
        ),
    }
    observer = redis.Redis.from_url(secured.url)
    try:
        deadline = time.monotonic() + 60
        while not _healthy(gateway_port):
            exited = [name for name, p in processes.items() if p.poll() is not None]
            assert not exited, f"{exited} exited:\n" + logs[exited[0]].read_text()
            assert time.monotonic() < deadline, "the worker never got registered"
            time.sleep(0.1)
        assert observer.exists(KEYS.ready)
        assert observer.exists(KEYS.worker_heartbeat("w-secure"))
        assert observer.exists(KEYS.gateway_heartbeat("gw-secure"))
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for name, process in processes.items():
            assert process.wait(timeout=20) == 0, logs[name].read_text()
    finally:
        observer.close()
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    scheduler_log = logs["scheduler"].read_text()
    assert '"event": "scheduler_started"' in scheduler_log
    for name, path in logs.items():
        assert PASSWORD not in path.read_text(), f"the {name} logged the password"
        assert quote(PASSWORD, safe="") not in path.read_text(), f"the {name} logged the URL"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.parametrize("module", ["scheduler_actor", "gateway"])
def test_an_actor_with_a_wrong_password_exits_2_saying_so_without_the_password(
    module, password_redis, prepared_model_dir, tmp_path
):
    """A refused login is final: retrying cannot fix a wrong password."""
    log_path = tmp_path / f"{module}.log"
    args = [f"--model={prepared_model_dir}", "--port=0"] if module == "gateway" else []
    process = _start(
        module,
        *args,
        env={**os.environ, "REDIS_URL": password_redis.wrong_password_url},
        log_path=log_path,
    )
    try:
        assert process.wait(timeout=60) == 2, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log_path.read_text()
    assert "Redis refused the login" in text and "invalid username-password pair" in text
    assert "wrong" not in text


# --- the embedded redis-server of `orcapod up` ----------------------------------------


def test_embedded_redis_has_a_random_password_and_refuses_anonymous_clients():
    first, second = start_embedded_redis(), start_embedded_redis()
    try:
        passwords = [
            embedded.url.split("@")[0].removeprefix("redis://:") for embedded in (first, second)
        ]
        assert passwords[0] != passwords[1]
        assert all(len(password) == 32 for password in passwords)
        # The password is in a mode-600 file, never on the command line.
        cmdline = Path(f"/proc/{first.child.pid}/cmdline").read_bytes()
        assert passwords[0].encode() not in cmdline
        assert (first.data_dir / "redis.conf").stat().st_mode & 0o777 == 0o600
        port = first.url.rsplit(":", 1)[1].split("/")[0]
        _refused(f"redis://127.0.0.1:{port}/0", AuthenticationError, "Authentication required")
        _refused(f"redis://:{passwords[1]}@127.0.0.1:{port}/0", AuthenticationError, "invalid")
        assert asyncio.run(_round_trip(first.url)) == WorkerLeft(worker_id="w-secure")
        # And it listens on loopback only.
        assert _bound_addresses(first.child.pid) == {"127.0.0.1"}
    finally:
        stop_children([first.child, second.child])
        remove_data(first)
        remove_data(second)


def _bound_addresses(pid: int) -> set[str]:
    """The local IPv4 addresses of ``pid``'s listening TCP sockets (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    addresses = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and inode in inodes:  # 0A: LISTEN
            raw = bytes.fromhex(local.split(":")[0])[::-1]
            addresses.add(".".join(str(b) for b in raw))
    # No IPv6 listener either.
    for line in Path(f"/proc/{pid}/net/tcp6").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:
            addresses.add("ipv6:" + fields[1])
    return addresses
