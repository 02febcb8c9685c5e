"""The pure parts of ``bench/control_plane.py``: Redis counters, window deltas, tables."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
from redis._parsers.helpers import parse_info

import bench.control_plane as cp

WORKER = "worker-0"

COMMANDSTATS_BEFORE = (
    "# Commandstats\r\n"
    "cmdstat_xadd:calls=100,usec=500,usec_per_call=5.00,rejected_calls=0,failed_calls=0\r\n"
    "cmdstat_publish:calls=10,usec=40,usec_per_call=4.00,rejected_calls=0,failed_calls=0\r\n"
    "cmdstat_info:calls=3,usec=90,usec_per_call=30.00,rejected_calls=0,failed_calls=0\r\n"
)
COMMANDSTATS_AFTER = (
    "# Commandstats\r\n"
    "cmdstat_xadd:calls=300,usec=1500,usec_per_call=5.00,rejected_calls=0,failed_calls=0\r\n"
    "cmdstat_publish:calls=10,usec=40,usec_per_call=4.00,rejected_calls=0,failed_calls=0\r\n"
    "cmdstat_info:calls=3,usec=90,usec_per_call=30.00,rejected_calls=0,failed_calls=0\r\n"
    "cmdstat_client|setname:calls=2,usec=2,usec_per_call=1.00,rejected_calls=0,failed_calls=0\r\n"
)


def test_commandstats_as_redis_py_parses_them_become_calls_and_usec_per_command() -> None:
    commands = cp.command_stats(parse_info(COMMANDSTATS_AFTER))

    assert commands["xadd"] == {"calls": 300.0, "usec": 1500.0}
    assert commands["client|setname"] == {"calls": 2.0, "usec": 2.0}
    assert set(commands) == {"xadd", "publish", "info", "client|setname"}


def test_command_deltas_keep_only_commands_called_in_the_window() -> None:
    before = cp.command_stats(parse_info(COMMANDSTATS_BEFORE))
    after = cp.command_stats(parse_info(COMMANDSTATS_AFTER))

    window = cp.command_deltas(before, after)

    # publish and info were not called in between; client|setname is new (counted from 0).
    assert window == {
        "xadd": {"calls": 200.0, "usec": 1000.0},
        "client|setname": {"calls": 2.0, "usec": 2.0},
    }


def test_stats_hash_fields_become_numbers_and_non_numbers_are_dropped() -> None:
    raw = {b"worker-0:num_steps": b"12", b"timing:forward_s": b"0.5", b"note": b"hello"}

    assert cp.stats_fields(raw) == {"worker-0:num_steps": 12.0, "timing:forward_s": 0.5}


def test_deltas_count_a_new_field_from_zero() -> None:
    assert cp.deltas({"a": 1.0, "b": 5.0}, {"a": 4.0, "c": 2.0}) == {"a": 3.0, "c": 2.0}


def test_gap_median_is_the_upper_edge_of_the_bucket_holding_half_the_gaps() -> None:
    prefix = f"{WORKER}:step_gap_le_us:"
    stats = {f"{prefix}100": 2.0, f"{prefix}300": 5.0, f"{prefix}1000": 1.0, f"{prefix}inf": 1.0}

    assert cp.gap_median_ms(stats, WORKER) == pytest.approx(0.3)
    assert cp.gap_median_ms({}, WORKER) is None


def _snapshot(at_s: float, stats: dict[str, float], **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "at_s": at_s,
        "stats": stats,
        "commands": {"xadd": {"calls": 0.0, "usec": 0.0}},
        "net_bytes": {"total_net_input_bytes": 0.0, "total_net_output_bytes": 0.0},
        "cpu_s": dict.fromkeys(cp.ROLES, 0.0),
        "machine_busy_s": 0.0,
        "num_tokens_received": 0,
    }
    values.update(overrides)
    return cp.Snapshot(**values)


def _window() -> tuple[Any, Any]:
    """10 s, 1,000 worker steps of batch 32 (800 timed by the scheduler)."""
    before = _snapshot(5.0, {f"{WORKER}:num_steps": 50.0, "timing:num_steps": 40.0})
    after_stats = {
        f"{WORKER}:num_steps": 1050.0,
        f"{WORKER}:num_requests": 32_000.0,
        f"{WORKER}:num_tokens": 33_000.0,
        f"{WORKER}:commit_s": 0.5,
        f"{WORKER}:step_gap_s": 0.25,
        f"{WORKER}:num_step_gaps": 1000.0,
        f"{WORKER}:step_gap_le_us:300": 1000.0,
        "timing:num_steps": 840.0,
        "timing:num_turns": 400.0,
        "timing:forward_s": 3.2,
        "timing:plan_transit_s": 0.4,
        "timing:turn_s": 0.16,
    }
    cpu = dict.fromkeys(cp.ROLES, 0.0) | {"worker": 8.0, "gateway": 4.0}
    after = _snapshot(
        15.0,
        after_stats,
        commands={"xadd": {"calls": 33_000.0, "usec": 20_000.0}},
        net_bytes={"total_net_input_bytes": 2e6, "total_net_output_bytes": 1e6},
        cpu_s=cpu,
        machine_busy_s=15.0,
        num_tokens_received=32_000,
    )
    return before, after


def test_service_row_divides_the_window_by_steps_and_seconds() -> None:
    before, after = _window()

    row = cp.service_row(before, after, WORKER)

    assert row["steps_per_s"] == pytest.approx(100.0)
    assert row["tokens_per_s"] == pytest.approx(3200.0)
    assert row["mean_batch"] == pytest.approx(32.0)
    assert row["turns_per_step"] == pytest.approx(0.5)
    ms = row["per_step_ms"]
    # Scheduler segments per timed step, the worker's per worker step.
    assert ms["forward"] == pytest.approx(4.0)
    assert ms["plan_transit"] == pytest.approx(0.5)
    assert ms["turn"] == pytest.approx(0.2)
    assert ms["result_transit"] == 0.0
    assert ms["publish"] == pytest.approx(0.5)
    assert ms["step_gap"] == pytest.approx(0.25)
    assert row["step_gap_p50_ms"] == pytest.approx(0.3)
    redis_per_step = row["redis_per_step"]
    assert redis_per_step["commands"] == pytest.approx(33.0)
    assert redis_per_step["bytes_in"] == pytest.approx(2000.0)
    assert redis_per_step["by_command"] == {"xadd": pytest.approx(33.0)}
    cores = row["cpu_cores"]
    assert cores["worker"] == pytest.approx(0.8)
    # 1.5 cores busy on the machine, 1.2 of them ours.
    assert cores["other"] == pytest.approx(0.3)


def test_a_window_without_worker_steps_is_an_error() -> None:
    before = _snapshot(0.0, {})
    with pytest.raises(RuntimeError, match="no step"):
        cp.service_row(before, _snapshot(1.0, {}), WORKER)


def _result(batch: int) -> dict[str, Any]:
    before, after = _window()
    service = cp.service_row(before, after, WORKER)
    alone = {"step_ms": 4.0, "forward_ms": 3.5, "tokens_per_s": 8000.0,
             "decode_at_context_ms": 4.2, "cpu_cores": 1.9, "other_cores": 0.0}  # fmt: skip
    return {"batch": batch, "engine_alone": alone, "service": service, "ratio": 0.4}


def test_tables_have_one_row_per_batch_and_as_many_cells_as_their_header() -> None:
    text = cp.render_tables([_result(32), _result(64)])

    blocks = [block.splitlines() for block in text.split("\n\n")]
    tables = [block for block in blocks if block[0].startswith("|")]
    assert len(tables) == 4
    for table in tables:
        widths = {line.count("|") for line in table}
        assert len(widths) == 1, table
        assert [row.split("|")[1].strip() for row in table[2:]] == ["32", "64"]
    assert "| 32 | 4.00 | 8,000 | 3,200 | 40% | 100 | 32.0 | 4.20 |" in tables[0]


def test_the_first_requests_end_spread_over_one_requests_life() -> None:
    workload = cp.Workload(batch=4, prompt_tokens=16, max_tokens=100, vocab_size=2048)

    assert [workload.first_max_tokens(i) for i in range(4)] == [1, 26, 51, 76]
    prompt = workload.prompt(random.Random(0))
    assert len(prompt) == 16 and all(cp.FIRST_TOKEN_ID <= t < 2048 for t in prompt)


def test_this_process_is_the_load_generator_and_its_cpu_is_counted() -> None:
    assert cp.role_of(os.getpid(), os.getpid()) == "load generator"
    cpu = cp.roles_cpu_s(os.getpid())
    assert cpu["load generator"] > 0
    assert cp.machine_busy_s() >= cpu["load generator"]


def test_the_engine_alone_before_and_after_the_service_is_averaged_field_by_field() -> None:
    before = {"step_ms": 5.0, "tokens_per_s": 6000.0, "num_steps": 100}
    after = {"step_ms": 6.0, "tokens_per_s": 5000.0, "num_steps": 90}

    assert cp.mean_row(before, after) == {"step_ms": 5.5, "tokens_per_s": 5500.0, "num_steps": 95}


def test_the_engine_gets_the_last_cpu_and_the_rest_the_others() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        with pytest.raises(SystemExit):
            cp.CpuSplit.of_this_machine()
        return
    split = cp.CpuSplit.of_this_machine()

    assert split.engine == {cpus[-1]} and split.rest == set(cpus[:-1])


def test_pinning_a_process_moves_every_thread_of_it_and_can_be_undone() -> None:
    own = frozenset(os.sched_getaffinity(0))
    one = frozenset([min(own)])
    try:
        cp.pin_process(os.getpid(), one)
        tasks = list(Path(f"/proc/{os.getpid()}/task").iterdir())
        assert all(os.sched_getaffinity(int(task.name)) == one for task in tasks)
    finally:
        cp.pin_process(os.getpid(), own)
    assert os.sched_getaffinity(0) == own


def test_pinning_the_service_counts_the_processes_it_moved_by_role() -> None:
    own = frozenset(os.sched_getaffinity(0))
    split = cp.CpuSplit(engine=own, rest=own)  # moves nothing anywhere new

    moved = cp.pin_service(os.getpid(), split)

    # This process is the load generator; what else runs under it (other
    # tests' children) depends on the suite, so only the roles are checked.
    assert moved["load generator"] == 1 and set(moved) == set(cp.ROLES)
