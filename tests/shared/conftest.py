"""Fixtures of the shared tests: real redis-servers with a password, an ACL user, TLS."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.conftest import free_port
from tests.shared.secured_redis import (
    ACL_USER,
    KEYS,
    PASSWORD,
    Certificates,
    SecuredRedis,
    make_certificates,
    running_redis,
    tls_query,
)


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[SecuredRedis]:
    """``requirepass``: the default user needs the password."""
    port = free_port()
    with running_redis(["--port", str(port), "--requirepass", PASSWORD], port, tmp_path) as process:
        address = f"127.0.0.1:{port}/0"
        yield SecuredRedis(
            url=f"redis://:{quote(PASSWORD, safe='')}@{address}",
            wrong_password_url=f"redis://:wrong@{address}",
            no_password_url=f"redis://{address}",
            process=process,
        )


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[SecuredRedis]:
    """An ACL user limited to the ``orcapod:`` keys and channels; the default user is off.

    The users are in an ACL file with the password's SHA-256, so the password
    itself is neither on redis-server's command line nor in a file.
    """
    port = free_port()
    digest = hashlib.sha256(PASSWORD.encode()).hexdigest()
    aclfile = tmp_path / "users.acl"
    aclfile.write_text(
        f"user {ACL_USER} on #{digest} ~{KEYS.prefix}:* &{KEYS.prefix}:* +@all\nuser default off\n"
    )
    with running_redis(["--port", str(port), "--aclfile", str(aclfile)], port, tmp_path) as process:
        address = f"127.0.0.1:{port}/0"
        yield SecuredRedis(
            url=f"redis://{ACL_USER}:{quote(PASSWORD, safe='')}@{address}",
            wrong_password_url=f"redis://{ACL_USER}:wrong@{address}",
            no_password_url=f"redis://{address}",
            process=process,
        )


@pytest.fixture
def certificates(tmp_path: Path) -> Certificates:
    return make_certificates(tmp_path / "certs")


@pytest.fixture
def tls_redis(tmp_path: Path, certificates: Certificates) -> Iterator[SecuredRedis]:
    """TLS only (``--port 0``), client certificates required, and a password."""
    port = free_port()
    args = [
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(certificates.server_cert),
        "--tls-key-file",
        str(certificates.server_key),
        "--tls-ca-cert-file",
        str(certificates.ca),
        "--tls-auth-clients",
        "yes",
        "--requirepass",
        PASSWORD,
    ]
    with running_redis(args, port, tmp_path) as process:
        address = f"127.0.0.1:{port}/0?{tls_query(certificates)}"
        yield SecuredRedis(
            url=f"rediss://:{quote(PASSWORD, safe='')}@{address}",
            wrong_password_url=f"rediss://:wrong@{address}",
            no_password_url=f"rediss://{address}",
            process=process,
        )
