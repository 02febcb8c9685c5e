"""``orcapod tenants``: make API keys and keep their hashes, in Redis or a TOML file.

- ``hash-key``: read a key on stdin, print its sha256 (for a tenants file).
- ``add-key --tenant NAME [quotas]``: a new random key, printed once; its hash
  goes into the Redis hash ``<prefix>:tenants`` (gateways pick it up within a
  couple of seconds), or with ``--toml`` is printed as a tenants-file section.
- ``list``, ``revoke SHA256``: the keys in Redis, and removing one.

Quotas given to ``add-key`` become the tenant's for every one of its keys in
Redis; quotas left out keep the tenant's current ones.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import cast

import msgspec
import redis
from redis.exceptions import RedisError

from gateway.tenants import (
    Tenant,
    TenantConfigError,
    decode_tenant_record,
    generate_key,
    hash_key,
    tenant_toml,
)
from shared.keys import RedisKeys
from shared.messages import encode
from shared.settings import add_redis_arguments, redis_settings_from_args

REDIS_TIMEOUT_S = 5.0
# A tenant's quotas, each an add-key flag, with its help.
QUOTA_HELP = {
    "max_queued": "requests waiting for a worker; more get queue_full "
    "(unset: the gateways' --default-max-queued)",
    "max_in_flight": "requests on workers at once; the rest wait (unset: no cap)",
    "max_tokens_per_request": "a larger max_tokens is an invalid_request (unset: no cap)",
    "tokens_per_minute": "prompt + max_tokens reserved in a minute, over all gateways; "
    "more get queue_full (unset: no cap)",
}
QUOTA_FIELDS = tuple(QUOTA_HELP)


def build_parser() -> argparse.ArgumentParser:
    """``orcapod tenants``' command line (``docs/configuration.md`` is made from it)."""
    parser = argparse.ArgumentParser(prog="orcapod tenants", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("hash-key", help="print the sha256 of the key read on stdin")
    add = commands.add_parser(
        "add-key",
        help="make a key for a tenant, print it once (quotas left out keep the tenant's)",
    )
    add.add_argument("--tenant", required=True, help="tenant name (letters, digits, _ . -)")
    add.add_argument("--weight", type=float, help="fair share against weight 1 (default 1)")
    for field in QUOTA_FIELDS:
        add.add_argument(
            f"--{field.replace('_', '-')}", type=int, dest=field, help=QUOTA_HELP[field]
        )
    add.add_argument(
        "--operator",
        action="store_true",
        help="its keys see every tenant's name on the dashboard",
    )
    add.add_argument(
        "--cache-group",
        help="tenants naming the same group share their cached prompt prefixes "
        "(letters, digits, _ . -)",
    )
    add.add_argument(
        "--toml", action="store_true", help="print a tenants-file section instead of using Redis"
    )
    add_redis_arguments(add)
    listing = commands.add_parser("list", help="the keys stored in Redis (hashes only)")
    add_redis_arguments(listing)
    revoke = commands.add_parser("revoke", help="remove a key from Redis by its sha256")
    revoke.add_argument("key_sha256", help="the key's sha256, as `list` shows it")
    add_redis_arguments(revoke)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``orcapod tenants``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "hash-key":
            return _hash_key()
        if args.command == "add-key" and args.toml:
            return _add_key_toml(args)
        client = redis.Redis.from_url(
            redis_settings_from_args(args).url, socket_timeout=REDIS_TIMEOUT_S
        )
        hash_name = RedisKeys(redis_settings_from_args(args).prefix).tenants
        with client:
            if args.command == "add-key":
                return _add_key_redis(args, client, hash_name)
            if args.command == "list":
                return _list(client, hash_name)
            return _revoke(args.key_sha256, client, hash_name)
    except TenantConfigError as error:
        print(f"orcapod tenants: {error}", file=sys.stderr)
        return 2
    except (RedisError, OSError) as error:
        print(f"orcapod tenants: cannot use Redis: {error}", file=sys.stderr)
        return 1


def _hash_key() -> int:
    key = sys.stdin.readline().strip()
    if not key:
        print("orcapod tenants hash-key: no key on stdin", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def _tenant(args: argparse.Namespace, current: Tenant | None) -> Tenant:
    """The tenant as ``add-key`` leaves it: the flags given, else what it had."""
    values = {field: getattr(current, field) if current else None for field in QUOTA_FIELDS}
    values.update({f: getattr(args, f) for f in QUOTA_FIELDS if getattr(args, f) is not None})
    weight = args.weight if args.weight is not None else (current.weight if current else 1.0)
    try:
        # Converted, not constructed: the same checks as when a gateway reads it.
        operator = args.operator or (current.operator if current else False)
        cache_group = args.cache_group or (current.cache_group if current else None)
        return msgspec.convert(
            {
                "name": args.tenant,
                "weight": weight,
                "operator": operator,
                "cache_group": cache_group,
                **values,
            },
            Tenant,
        )
    except msgspec.ValidationError as error:
        raise TenantConfigError(str(error)) from error


def _add_key_toml(args: argparse.Namespace) -> int:
    tenant = _tenant(args, None)
    key = generate_key()
    print(key)
    print("(the key is not kept anywhere: copy it now; the tenants file gets only its hash)\n")
    print(tenant_toml(tenant, [hash_key(key)]), end="")
    return 0


def _add_key_redis(args: argparse.Namespace, client: redis.Redis, hash_name: str) -> int:
    records = _records(client, hash_name)
    same_tenant = {h: t for h, t in records.items() if t.name == args.tenant}
    tenant = _tenant(args, next(iter(same_tenant.values()), None))
    key = generate_key()
    data = encode(tenant)
    # Every key of the tenant gets the same quotas: they are the tenant's, not the key's.
    client.hset(hash_name, mapping={hash_key(key): data, **dict.fromkeys(same_tenant, data)})
    print(key)
    print(
        f"key for tenant {tenant.name!r} stored in {hash_name} (sha256 {hash_key(key)[:16]}...); "
        "it is not kept anywhere else: copy it now",
        file=sys.stderr,
    )
    return 0


def _list(client: redis.Redis, hash_name: str) -> int:
    for digest, tenant in sorted(_records(client, hash_name).items(), key=lambda e: e[1].name):
        quotas = " ".join(
            f"{field}={getattr(tenant, field)}"
            for field in QUOTA_FIELDS
            if getattr(tenant, field) is not None
        )
        print(f"{digest}  {tenant.name}  weight={tenant.weight} {quotas}".rstrip())
    return 0


def _revoke(key_sha256: str, client: redis.Redis, hash_name: str) -> int:
    if not client.hdel(hash_name, key_sha256.lower()):
        print(f"orcapod tenants revoke: no key {key_sha256} in {hash_name}", file=sys.stderr)
        return 1
    print("revoked; gateways refuse new connections with it within seconds", file=sys.stderr)
    return 0


def _records(client: redis.Redis, hash_name: str) -> dict[str, Tenant]:
    records: dict[str, Tenant] = {}
    # Replies are bytes: the client is made without decode_responses.
    entries = cast(dict[bytes, bytes], client.hgetall(hash_name))
    for raw_field, data in entries.items():
        field = raw_field.decode("utf-8", "replace")
        try:
            records[field] = decode_tenant_record(data)
        except TenantConfigError as error:
            print(f"skipping {field[:16]}...: {error}", file=sys.stderr)
    return records
