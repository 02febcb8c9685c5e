"""Samples of the service's processes for the soak (``bench/soak.py``).

Resident memory (``/proc/PID/status`` VmRSS) and open file descriptors
(``/proc/PID/fd``) of each process, Redis's own census of its keys, the
growth between the first sample after a warm-up and the last one, and how to
find the processes one ``orcapod up`` started. Linux only (``/proc``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from shared.keys import RedisKeys

MAX_RSS_GROWTH = 0.05
# Sockets of the churn that happen to be open at a sample, and redis-py's pool
# opening one more connection under a burst, are not leaks.
FD_TOLERANCE = 8


@dataclass(frozen=True)
class ProcessSample:
    """One reading of one process."""

    t_s: float
    rss_kib: int
    num_fds: int


def read_sample(pid: int, t_s: float) -> ProcessSample:
    """Resident memory (VmRSS) and number of open file descriptors of ``pid`` now."""
    rss_kib = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    num_fds = sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())
    return ProcessSample(t_s, rss_kib, num_fds)


@dataclass(frozen=True)
class Growth:
    """One process over the soak, from the first sample after the warm-up to the last."""

    rss_start_mib: float
    rss_end_mib: float
    rss_growth_pct: float
    rss_peak_mib: float
    fds_start: int
    fds_end: int
    num_samples: int

    @property
    def rss_ok(self) -> bool:
        return self.rss_growth_pct < 100 * MAX_RSS_GROWTH

    @property
    def fds_ok(self) -> bool:
        return self.fds_end <= self.fds_start + FD_TOLERANCE


def growth(samples: Sequence[ProcessSample], warmup_s: float) -> Growth:
    """RSS and fds from the first sample at or after ``warmup_s`` to the last sample."""
    steady = [sample for sample in samples if sample.t_s >= warmup_s]
    if len(steady) < 2:
        raise ValueError(
            f"{len(steady)} sample(s) after the {warmup_s} s warm-up: run longer or sample more"
        )
    first, last = steady[0], steady[-1]
    return Growth(
        rss_start_mib=round(first.rss_kib / 1024, 1),
        rss_end_mib=round(last.rss_kib / 1024, 1),
        rss_growth_pct=round(100 * (last.rss_kib - first.rss_kib) / first.rss_kib, 2),
        rss_peak_mib=round(max(sample.rss_kib for sample in steady) / 1024, 1),
        fds_start=first.num_fds,
        fds_end=last.num_fds,
        num_samples=len(steady),
    )


@dataclass(frozen=True)
class RedisCensus:
    """Redis's own view at one sample: memory, keys, and keys that never expire."""

    t_s: float
    used_memory_kib: int
    num_keys: int
    num_keys_without_ttl: int
    num_request_logs: int


async def redis_census(client: aioredis.Redis, keys: RedisKeys, t_s: float) -> RedisCensus:
    """Count every key (SCAN) and those without a TTL (TTL -1): the latter are
    the ones that could grow without bound; request logs expire by design."""
    info = await client.info("memory")
    names = [name async for name in client.scan_iter(count=1000)]
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.ttl(name)
    ttls = await pipe.execute() if names else []
    log_prefix = keys.request_log("").encode()
    return RedisCensus(
        t_s=t_s,
        used_memory_kib=int(info["used_memory"]) // 1024,
        num_keys=len(names),
        num_keys_without_ttl=sum(1 for ttl in ttls if ttl == -1),
        num_request_logs=sum(1 for name in names if name.startswith(log_prefix)),
    )


def census_growth(census: Sequence[RedisCensus], warmup_s: float) -> dict[str, int]:
    """The census at the first sample after ``warmup_s`` and at the last one."""
    steady = [sample for sample in census if sample.t_s >= warmup_s]
    if len(steady) < 2:
        raise ValueError(f"{len(steady)} Redis census(es) after the {warmup_s} s warm-up")
    first, last = steady[0], steady[-1]
    return {
        "used_memory_start_kib": first.used_memory_kib,
        "used_memory_end_kib": last.used_memory_kib,
        "keys_start": first.num_keys,
        "keys_end": last.num_keys,
        "keys_without_ttl_start": first.num_keys_without_ttl,
        "keys_without_ttl_end": last.num_keys_without_ttl,
        "request_logs_start": first.num_request_logs,
        "request_logs_end": last.num_request_logs,
    }


def service_pids(gateway_port: int, redis_pid: int, proc: Path = Path("/proc")) -> dict[str, int]:
    """The pids of the service ``orcapod up`` started: the gateway listening on
    ``gateway_port``, its siblings (children of the same ``orcapod up``) and redis."""
    processes: dict[int, tuple[int, list[str]]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        processes[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), argv)

    def runs(argv: list[str], module: str) -> bool:
        return any(argv[i : i + 2] == ["-m", module] for i in range(len(argv) - 1))

    gateways = [
        pid
        for pid, (_, argv) in processes.items()
        if runs(argv, "gateway")
        and any(argv[i : i + 2] == ["--port", str(gateway_port)] for i in range(len(argv) - 1))
    ]
    if len(gateways) != 1:
        raise RuntimeError(f"expected one gateway on port {gateway_port}, found {gateways}")
    launcher = processes[gateways[0]][0]
    siblings = {pid: argv for pid, (parent, argv) in processes.items() if parent == launcher}
    found = {"gateway": gateways[0], "redis": redis_pid}
    for role, module in (("scheduler", "scheduler_actor"), ("worker", "gpu_worker")):
        matches = [pid for pid, argv in siblings.items() if runs(argv, module)]
        if len(matches) != 1:
            raise RuntimeError(f"expected one {module} beside the gateway, found {matches}")
        found[role] = matches[0]
    return found
