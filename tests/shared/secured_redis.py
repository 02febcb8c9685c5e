"""Real redis-servers behind a password, an ACL user or TLS, for the security tests;
the TLS certificates are made with the ``openssl`` command."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.keys import RedisKeys
from tests.conftest import start_redis_server, stop_process

PASSWORD = "s3cr3t/p@ss:w0rd"  # "/", "@" and ":" must be percent-encoded in the URL
ACL_USER = "orcapod-actor"
KEYS = RedisKeys("orcapod")
START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SecuredRedis:
    """A redis-server child and the URLs that should and should not reach it."""

    url: str
    wrong_password_url: str
    no_password_url: str
    process: subprocess.Popen[bytes]


@contextmanager
def running_redis(args: list[str], port: int, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    process = start_redis_server(port, tmp_path, tmp_path / "redis.log", *args)
    try:
        yield process
    finally:
        stop_process(process)


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    executable = shutil.which("openssl")
    if executable is None:
        pytest.fail("the openssl command is needed to make the TLS test certificates")
    subprocess.run([executable, *map(str, args)], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> Certificates:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost, a client certificate."""
    directory.mkdir()
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *key,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=orcapod test CA",
        cwd=directory,
    )
    for name, extensions in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (directory / f"{name}.ext").write_text(extensions)
        _openssl(
            "req",
            *key,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=orcapod {name}",
            cwd=directory,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            cwd=directory,
        )
    return Certificates(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


def tls_query(certificates: Certificates, *, client_cert: bool = True) -> str:
    """The ``rediss://`` query string: trust our CA, verify the server, maybe show a cert."""
    query = f"ssl_ca_certs={certificates.ca}&ssl_cert_reqs=required"
    if client_cert:
        query += f"&ssl_certfile={certificates.client_cert}&ssl_keyfile={certificates.client_key}"
    return query
