"""The pure parts of the soak (``bench/soak.py``, ``orcapod/bench/soak_samples.py``):
/proc sampling, growth, finding the service's processes, request tallies (the
5-minute soak itself is run by hand: `make soak`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import bench.soak as soak
from orcapod.bench import soak_samples as samples


def test_read_sample_sees_this_process_memory_and_a_new_fd(tmp_path: Path) -> None:
    before = samples.read_sample(os.getpid(), 1.5)
    assert before.t_s == 1.5 and before.rss_kib > 1024 and before.num_fds >= 3
    with (tmp_path / "f").open("w"):
        during = samples.read_sample(os.getpid(), 2.0)
    assert during.num_fds == before.num_fds + 1


def test_growth_starts_after_the_warmup_and_flags_leaks() -> None:
    sample = samples.ProcessSample
    readings = [
        sample(0.0, 50_000, 10),  # warm-up: caches fill, not counted
        sample(25.0, 90_000, 12),
        sample(30.0, 100_000, 12),
        sample(60.0, 106_000, 30),
        sample(90.0, 104_000, 13),
    ]
    result = samples.growth(readings, warmup_s=30.0)
    assert result.rss_start_mib == round(100_000 / 1024, 1)
    assert result.rss_end_mib == round(104_000 / 1024, 1)
    assert result.rss_growth_pct == 4.0 and result.rss_ok
    assert result.rss_peak_mib == round(106_000 / 1024, 1)
    assert (result.fds_start, result.fds_end, result.num_samples) == (12, 13, 3)
    assert result.fds_ok

    leaking = [*readings, sample(120.0, 106_000, 12 + samples.FD_TOLERANCE + 1)]
    grown = samples.growth(leaking, warmup_s=30.0)
    assert grown.rss_growth_pct == 6.0 and not grown.rss_ok
    assert not grown.fds_ok
    # Shrinking is fine.
    assert samples.growth([sample(0, 100, 5), sample(9, 90, 4)], warmup_s=0).rss_ok

    with pytest.raises(ValueError, match="warm-up"):
        samples.growth(readings, warmup_s=90.0)


def _fake_process(proc: Path, pid: int, parent: int, argv: list[str]) -> None:
    entry = proc / str(pid)
    entry.mkdir()
    # The command name may hold spaces and parentheses: the parent follows the last ")".
    (entry / "stat").write_text(f"{pid} (python (x)) S {parent} {pid} 0 0")
    (entry / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")


def test_service_pids_finds_the_gateway_by_port_and_its_siblings(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "self").mkdir()  # not a pid: ignored
    python = "/venv/bin/python"
    # Our `orcapod up` (pid 100) and someone else's (pid 200), on another port.
    for up, port, first in ((100, 8000, 101), (200, 9000, 201)):
        _fake_process(proc, up, 1, [python, "-m", "orcapod", "up", "--port", str(port)])
        _fake_process(proc, first, up, [python, "-m", "scheduler_actor", "--policy", "fair"])
        _fake_process(proc, first + 1, up, [python, "-m", "gpu_worker", "--worker-id", "w-0"])
        gateway = [python, "-m", "gateway", "--gateway-id", "g-0", "--port", str(port)]
        _fake_process(proc, first + 2, up, gateway)
    _fake_process(proc, 300, 1, ["redis-server", "127.0.0.1:6000"])

    pids = samples.service_pids(9000, redis_pid=300, proc=proc)
    assert pids == {"gateway": 203, "scheduler": 201, "worker": 202, "redis": 300}
    with pytest.raises(RuntimeError, match="one gateway on port 7000"):
        samples.service_pids(7000, redis_pid=300, proc=proc)


def test_tally_counts_answers_errors_and_what_is_left() -> None:
    tally = soak.Tally()
    for client_id in ("a", "b", "c"):
        tally.start(client_id)
    tally.finish("a", tokens=6)
    tally.finish("b", error="queue_full")
    tally.finish("b", tokens=3)  # a second answer for the same request counts once
    summary = tally.summary()
    assert summary["sent"] == 3 and summary["answered"] == 2 and summary["unanswered"] == 1
    assert summary["done"] == 1 and summary["tokens"] == 6
    assert summary["errors"] == {"queue_full": 1}


def test_requests_are_short_and_ignore_eos() -> None:
    frames = [json.loads(soak.generate_frame(f"r{n}", n, max_tokens=8)) for n in range(20)]
    assert {frame["max_tokens"] for frame in frames} == {4, 5, 6, 7, 8}
    assert all(frame["ignore_eos"] and frame["type"] == "generate" for frame in frames)
    assert [frame["id"] for frame in frames] == [f"r{n}" for n in range(20)]


def test_census_growth_compares_the_first_steady_census_with_the_last() -> None:
    census = [
        samples.RedisCensus(0.0, 10_000, 2_000, 9, 1_990),  # the burst's logs, during warm-up
        samples.RedisCensus(30.0, 12_000, 1_050, 9, 1_040),
        samples.RedisCensus(60.0, 13_000, 1_110, 9, 1_100),
    ]
    assert samples.census_growth(census, warmup_s=30.0) == {
        "used_memory_start_kib": 12_000,
        "used_memory_end_kib": 13_000,
        "keys_start": 1_050,
        "keys_end": 1_110,
        "keys_without_ttl_start": 9,
        "keys_without_ttl_end": 9,
        "request_logs_start": 1_040,
        "request_logs_end": 1_100,
    }
    with pytest.raises(ValueError):
        samples.census_growth(census[:2], warmup_s=30.0)
