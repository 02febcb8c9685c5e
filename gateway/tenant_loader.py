"""Keeps a gateway's tenant table current from its two sources, without a restart.

The TOML file is re-read when its mtime (or size) changes, the Redis hash on
every reload; the gateway calls ``reload`` every couple of seconds and on
SIGHUP. ``load`` (at start) raises on a broken file; ``reload`` instead keeps
the table it had and logs an error, so a bad edit never locks every client
out. In the Redis hash, an entry that does not decode is skipped (logged):
a broken record must not grant anything.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gateway.tenants import (
    Tenant,
    TenantConfigError,
    TenantTable,
    decode_tenant_record,
    parse_tenants_toml,
)

logger = structlog.get_logger(__name__)

_KEY_HASH = re.compile(r"^[0-9a-f]{64}$")


class TenantLoader:
    """The merged table of a tenants file (which wins for a key in both) and a Redis hash."""

    def __init__(self, tenants_file: Path | None, redis: aioredis.Redis, hash_name: str) -> None:
        self._file = tenants_file
        self._redis = redis
        self._hash_name = hash_name
        self._file_table = TenantTable()
        # (mtime_ns, size) of the file as last read, broken or not, so a broken
        # file is reported once per change rather than at every reload.
        self._file_seen: tuple[int, int] | None = None
        self._file_missing = False
        self._redis_table = TenantTable()
        self.table = TenantTable()

    async def load(self) -> TenantTable:
        """The first load: raises TenantConfigError for a broken or missing file,
        and RedisError/OSError when Redis cannot be read."""
        if self._file is not None:
            try:
                self._file_seen = _signature(self._file)
            except OSError as error:
                raise TenantConfigError(f"cannot read {self._file}: {error}") from error
            self._file_table = _read_file(self._file)
        self._redis_table = await self._read_redis()
        self._merge()
        logger.info(
            "tenants_loaded",
            num_keys=self.table.num_keys,
            file=str(self._file) if self._file else None,
        )
        return self.table

    async def reload(self, *, force_file: bool = False) -> bool:
        """Re-read what changed (the file also when unchanged with ``force_file``:
        SIGHUP); True when the table changed. Never raises for a bad source: the
        previous part of the table stays."""
        self._reload_file(force_file)
        try:
            self._redis_table = await self._read_redis()
        except (RedisError, OSError) as error:
            # The keys it had are kept.
            logger.warning("tenants_hash_unreadable", error=str(error))
        previous = self.table
        self._merge()
        changed = self.table != previous
        if changed:
            logger.info("tenants_reloaded", num_keys=self.table.num_keys)
        return changed

    def _reload_file(self, force: bool) -> None:
        if self._file is None:
            return
        try:
            signature = _signature(self._file)
        except OSError as error:
            if not self._file_missing:
                logger.error(
                    "tenants_file_unreadable",  # its previous keys are kept
                    file=str(self._file),
                    error=str(error),
                )
            self._file_missing = True
            return
        self._file_missing = False
        if signature == self._file_seen and not force:
            return
        self._file_seen = signature
        try:
            self._file_table = _read_file(self._file)
        except (TenantConfigError, OSError) as error:
            logger.error(
                "tenants_file_broken",  # its previous keys are kept
                file=str(self._file),
                error=str(error),
            )

    async def _read_redis(self) -> TenantTable:
        # The client keeps replies as bytes (every payload is MessagePack).
        entries = cast(dict[bytes, bytes], await self._redis.hgetall(self._hash_name))
        by_hash: dict[str, Tenant] = {}
        for raw_field, data in entries.items():
            field = raw_field.decode("utf-8", "replace")
            if not _KEY_HASH.match(field):
                logger.error("tenants_hash_field_skipped", field=field[:80], reason="not a sha256")
                continue
            try:
                by_hash[field] = decode_tenant_record(data)
            except TenantConfigError as error:
                logger.error("tenants_hash_record_skipped", key_sha256=field, error=str(error))
        return TenantTable(by_hash)

    def _merge(self) -> None:
        self.table = self._file_table.merged_with(self._redis_table)


def _signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


def _read_file(path: Path) -> TenantTable:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TenantConfigError(f"cannot read {path}: {error}") from error
    return parse_tenants_toml(text, source=str(path))
