"""Tenants, their quotas and API keys: the table a gateway authenticates against. Pure.

A key is never stored, only its sha256 (hex). Two sources fill the table: a
TOML file (``--tenants-file``) and the Redis hash ``<prefix>:tenants`` (field:
the key's sha256, value: a MessagePack :class:`Tenant`); ``gateway/tenant_loader.py``
reads them, this module parses, merges and looks up. The TOML file::

    [tenants.acme]
    weight = 2.0                  # VTC share against weight 1 (default 1)
    max_queued = 100              # requests waiting for a worker (default: no cap)
    max_in_flight = 8             # requests on workers at once; the rest wait
    max_tokens_per_request = 1024 # a larger max_tokens is an invalid_request
    cache_group = "acme-apps"     # tenants of one group share cached prompt prefixes
    tokens_per_minute = 200000    # prompt + max_tokens reserved, over all gateways
    operator = true               # its keys see every tenant's name on /dashboard
    key_sha256 = ["<sha256 hex of a key>", ...]

How a handshake presents its key, and when the open tenant ``default``
serves keyless clients, is ``gateway/handshake.py``'s business.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated

import msgspec

from shared.messages import CacheGroupName, TenantLimits

OPEN_TENANT_NAME = "default"
# Generated keys start with it, so a leaked key is recognisable in a scan.
GENERATED_KEY_PREFIX = "opk_"
TOKENS_WINDOW_S = 60
TENANT_RECORD_VERSION = 1

KeyHash = Annotated[str, msgspec.Meta(pattern="^[0-9a-fA-F]{64}$")]
# It becomes part of Redis key names and log lines.
TenantName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class TenantConfigError(ValueError):
    """A tenants file or record that cannot be used; the message says where and why."""


class UnprotectedHostError(TenantConfigError):
    """A gateway asked to listen beyond loopback while no API key is configured."""


class TenantQuotas(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A tenant's weight and quotas; None means no cap."""

    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    max_queued: PositiveInt | None = None
    max_in_flight: PositiveInt | None = None
    max_tokens_per_request: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    # An operator's keys see every tenant's name on the dashboard; everyone
    # else sees their own and "tenant 2", "tenant 3"... for the others.
    operator: bool = False
    # Tenants naming the same group share their prefix cache (and can time it);
    # without one a tenant's cache is its own.
    cache_group: CacheGroupName | None = None


class Tenant(TenantQuotas, frozen=True, kw_only=True):
    """One tenant; also the value of a field of the Redis hash of keys."""

    name: TenantName
    version: int = TENANT_RECORD_VERSION

    @property
    def limits(self) -> TenantLimits:
        """What the scheduler enforces (the gateway enforces the rest itself)."""
        return TenantLimits(
            weight=self.weight,
            max_queued=self.max_queued,
            max_in_flight=self.max_in_flight,
            cache_group=self.cache_group,
        )


OPEN_TENANT = Tenant(name=OPEN_TENANT_NAME)


class _FileTenant(TenantQuotas, frozen=True, kw_only=True):
    key_sha256: list[KeyHash] = []


class _TenantsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tenants: dict[TenantName, _FileTenant] = {}


_record_decoder = msgspec.msgpack.Decoder(Tenant)


def hash_key(key: str) -> str:
    """The sha256 hex digest of an API key: the only form in which keys are kept."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_key() -> str:
    """A new random API key (256 bits), usable in a header and as a subprotocol."""
    return GENERATED_KEY_PREFIX + secrets.token_urlsafe(32)


def decode_tenant_record(data: bytes) -> Tenant:
    """A Tenant from the Redis hash; raises TenantConfigError on anything else."""
    try:
        return _record_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise TenantConfigError(f"bad tenant record: {error}") from error


class TenantTable:
    """Every configured key (by sha256) and its tenant. Immutable once built."""

    __slots__ = ("_by_hash", "_entries")

    def __init__(self, by_hash: Mapping[str, Tenant] | None = None) -> None:
        self._by_hash: dict[str, Tenant] = {h.lower(): t for h, t in (by_hash or {}).items()}
        self._entries = [(h.encode("ascii"), t) for h, t in self._by_hash.items()]

    @property
    def num_keys(self) -> int:
        """How many keys open the gateway (0: no auth configured)."""
        return len(self._by_hash)

    @property
    def by_hash(self) -> Mapping[str, Tenant]:
        """Every key's sha256 and its tenant."""
        return self._by_hash

    def lookup(self, key: str) -> Tenant | None:
        """The tenant of ``key``, or None when it is not a configured key."""
        digest = hash_key(key).encode("ascii")
        # Every stored hash is compared, each in constant time and without
        # stopping at a match, so a handshake's timing says nothing about how
        # close a guess came to any key. A handshake is rare next to tokens.
        found: Tenant | None = None
        for stored, tenant in self._entries:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def merged_with(self, other: TenantTable) -> TenantTable:
        """Both tables' keys; where both hold a key, this table's tenant wins."""
        return TenantTable({**other.by_hash, **self._by_hash})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TenantTable) and self._by_hash == other._by_hash

    __hash__ = None  # type: ignore[assignment]


def parse_tenants_toml(text: str, source: str = "tenants file") -> TenantTable:
    """The table a TOML tenants file describes; raises TenantConfigError saying what is wrong."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TenantConfigError(f"{source}: not valid TOML: {error}") from error
    try:
        parsed = msgspec.convert(raw, _TenantsFile)
    except msgspec.ValidationError as error:
        raise TenantConfigError(
            f"{source}: {error} (key_sha256 holds sha256 hex digests of keys, "
            "see `orcapod tenants hash-key`)"
        ) from error
    by_hash: dict[str, Tenant] = {}
    for name, entry in parsed.tenants.items():
        # Every quota the file may set, by the one definition of them (a field
        # copied by hand was once left out: cache_group).
        quotas = {field: getattr(entry, field) for field in TenantQuotas.__struct_fields__}
        tenant = Tenant(name=name, **quotas)
        for digest in entry.key_sha256:
            digest = digest.lower()
            holder = by_hash.get(digest)
            if holder is not None:
                raise TenantConfigError(
                    f"{source}: key {digest[:12]}... is listed for both {holder.name!r} "
                    f"and {name!r}"
                )
            by_hash[digest] = tenant
    return TenantTable(by_hash)


def tenant_toml(tenant: Tenant, key_hashes: Iterable[str]) -> str:
    """The TOML section of one tenant, as a tenants file holds it."""
    lines = [f"[tenants.{tenant.name}]", f"weight = {float(tenant.weight)}"]
    for field in ("max_queued", "max_in_flight", "max_tokens_per_request", "tokens_per_minute"):
        value = getattr(tenant, field)
        if value is not None:
            lines.append(f"{field} = {value}")
    if tenant.operator:
        lines.append("operator = true")
    if tenant.cache_group is not None:
        lines.append(f'cache_group = "{tenant.cache_group}"')
    lines.append("key_sha256 = [" + ", ".join(f'"{h}"' for h in key_hashes) + "]")
    return "\n".join(lines) + "\n"


# --- where the gateway may be open ---------------------------------------------


def is_loopback_host(host: str) -> bool:
    """Whether binding ``host`` keeps the gateway reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


# --- tokens per minute --------------------------------------------------------------


@dataclass(frozen=True)
class TokenReservation:
    """Tokens a request reserves of its tenant's per-minute budget at admission."""

    tenant: str
    num_tokens: int
    tokens_per_minute: int


def tokens_window(now_s: float) -> tuple[int, float]:
    """The fixed window ``now_s`` (wall clock) falls in, and the seconds until it ends."""
    index = int(now_s // TOKENS_WINDOW_S)
    return index, (index + 1) * TOKENS_WINDOW_S - now_s


def over_tokens_per_minute(reservation: TokenReservation, num_used: int, retry_in_s: float) -> str:
    """The ``queue_full`` message of a request over its tenant's per-minute budget."""
    return (
        f"tenant {reservation.tenant!r} is over its tokens-per-minute limit "
        f"({reservation.tokens_per_minute}; {num_used} reserved this minute, this request "
        f"needs {reservation.num_tokens}); retry in {max(1, round(retry_in_s))} s"
    )
