"""The K/V pool's size: the pure rule (``size_kv_cache``), its flags, a worker
built with the defaults on this machine, and a start that cannot fit."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from gpu_worker.__main__ import parse_settings
from gpu_worker.engine_host import EngineStartFailed, build_engine
from gpu_worker.kv_cache import (
    KVCacheBudget,
    KVCacheLimit,
    KVCacheSizeError,
    bytes_per_block,
    format_bytes,
    kv_cache_size,
    size_kv_cache,
    stable_block_count,
)
from gpu_worker.model_config import load_model_config
from shared.settings import (
    DEFAULT_KV_CACHE_FRACTIONS,
    DEFAULT_KV_CACHE_MAX_SEQUENCES,
    RedisSettings,
    SchedulerSettings,
    WorkerSettings,
    default_kv_cache_fraction,
    model_location,
)
from tests.gpu_worker.tiny_models import write_tiny_model

BLOCK_BYTES = 1000
CONTEXT = 100  # tokens: 7 blocks of 16 (the last one part full)
SEQUENCE_BYTES = 7 * BLOCK_BYTES
GIB = 1 << 30


def _size(budget: KVCacheBudget, available_bytes: int, default_fraction: float = 0.1):
    return size_kv_cache(
        budget,
        bytes_per_block=BLOCK_BYTES,
        max_context_tokens=CONTEXT,
        available_bytes=available_bytes,
        default_fraction=default_fraction,
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def _settings(model_dir: Path, **kv: object) -> WorkerSettings:
    return WorkerSettings(
        redis=RedisSettings(url="redis://127.0.0.1:1"),
        model=model_location(model_dir=str(model_dir)),
        worker_id="w-kv",
        device="cpu",
        compile_decode=False,  # the pool's size does not depend on it; compiling takes minutes
        **kv,  # type: ignore[arg-type]
    )


# --- the rule -----------------------------------------------------------------------


def test_the_batch_and_context_cap_binds_when_memory_is_plentiful() -> None:
    size = _size(KVCacheBudget(max_sequences=4), available_bytes=GIB)
    assert size.limited_by is KVCacheLimit.MAX_SEQUENCES
    assert size.num_blocks == 4 * 7 and size.num_full_sequences == 4
    assert size.num_bytes == 4 * SEQUENCE_BYTES


def test_memory_binds_below_the_cap() -> None:
    available = 1_000_000
    size = _size(KVCacheBudget(fraction=0.05), available_bytes=available)
    assert size.limited_by is KVCacheLimit.MEMORY
    # 50 blocks' worth, kept to 4 significant bits (stable_block_count): 48.
    assert size.num_blocks == 48 and size.fraction == 0.05
    assert size.num_blocks < DEFAULT_KV_CACHE_MAX_SEQUENCES * 7
    # Exactly at the cap, memory is what bound it.
    at_cap = _size(KVCacheBudget(fraction=0.5, max_sequences=2), available_bytes=28_000)
    assert (at_cap.num_blocks, at_cap.limited_by) == (14, KVCacheLimit.MEMORY)


def test_a_pool_sized_from_memory_keeps_its_size_when_memory_moves_a_little() -> None:
    """The pool's size is a constant of the compiled graphs: two starts whose free
    memory differs by a little get one size, and so one entry in inductor's cache."""
    assert stable_block_count(3098) == stable_block_count(3095) == 3072
    assert [stable_block_count(n) for n in (1, 15, 16, 17, 31, 32, 33)] == [
        1,
        15,
        16,
        16,
        30,
        32,
        32,
    ]
    for num_blocks in range(1, 5000):
        kept = stable_block_count(num_blocks)
        assert num_blocks * 7 / 8 < kept <= num_blocks
    sizes = {
        _size(KVCacheBudget(fraction=0.1), available_bytes=available).num_blocks
        for available in range(3_000_000, 3_100_000, 7_000)
    }
    assert sizes == {288}  # 300 to 310 blocks of memory
    # Never below one sequence of the full context (7 blocks here).
    assert _size(KVCacheBudget(fraction=0.5), available_bytes=14_000).num_blocks == 7


def test_the_device_default_fraction_applies_when_none_is_given() -> None:
    available = 1_000_000
    assert _size(KVCacheBudget(), available, default_fraction=0.02).num_blocks == 20
    assert _size(KVCacheBudget(), available, default_fraction=0.03).num_blocks == 30
    assert default_kv_cache_fraction("cpu") == DEFAULT_KV_CACHE_FRACTIONS["cpu"]
    assert default_kv_cache_fraction("cuda") == DEFAULT_KV_CACHE_FRACTIONS["cuda"]
    assert all(0 < fraction < 1 for fraction in DEFAULT_KV_CACHE_FRACTIONS.values())
    # The cap's default is the scheduler's bound on the requests placed on a worker.
    assert SchedulerSettings.max_batch_size == DEFAULT_KV_CACHE_MAX_SEQUENCES


def test_explicit_bytes_win_over_the_fraction_and_the_cap() -> None:
    size = _size(KVCacheBudget(num_bytes=100 * BLOCK_BYTES + 5, max_sequences=1), GIB)
    assert (size.num_blocks, size.limited_by) == (100, KVCacheLimit.KV_CACHE_BYTES)
    # Below one full-context sequence is allowed when asked for: shorter requests fit.
    small = _size(KVCacheBudget(num_bytes=3 * BLOCK_BYTES), GIB)
    assert small.num_blocks == 3 and small.num_full_sequences == 0
    assert small.log_fields()["max_sequence_tokens"] == 3 * 16


def test_explicit_bytes_must_hold_a_block_and_fit_in_memory() -> None:
    with pytest.raises(KVCacheSizeError, match="not even one block"):
        _size(KVCacheBudget(num_bytes=BLOCK_BYTES - 1), GIB)
    with pytest.raises(KVCacheSizeError) as raised:
        _size(KVCacheBudget(num_bytes=2 * GIB), GIB)
    message = str(raised.value)
    assert format_bytes(2 * GIB) in message and format_bytes(GIB) in message
    assert "--kv-cache-bytes" in message


def test_a_pool_without_room_for_one_full_context_stops_the_start() -> None:
    available = 100_000  # 0.05 of it buys 5 blocks; one sequence takes 7
    with pytest.raises(KVCacheSizeError) as raised:
        _size(KVCacheBudget(fraction=0.05), available)
    message = str(raised.value)
    # What was needed, what was available, which flags to change.
    assert f"{CONTEXT} tokens need {format_bytes(SEQUENCE_BYTES)}" in message
    assert f"the {format_bytes(available)} available" in message
    assert "raise --kv-cache-fraction to 0.07 or more" in message
    assert "--kv-cache-bytes" in message
    _size(KVCacheBudget(fraction=0.07), available)  # the fraction it named is enough


def test_when_no_fraction_could_hold_one_sequence_the_error_says_free_memory() -> None:
    with pytest.raises(KVCacheSizeError, match="free memory, or set --kv-cache-bytes"):
        _size(KVCacheBudget(fraction=0.9), available_bytes=SEQUENCE_BYTES)
    with pytest.raises(KVCacheSizeError, match="free memory"):
        _size(KVCacheBudget(), available_bytes=0)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.25, 1.5, math.nan, math.inf])
def test_a_fraction_outside_zero_to_one_is_refused(fraction: float) -> None:
    with pytest.raises(KVCacheSizeError, match=r"--kv-cache-fraction must be above 0 and below 1"):
        KVCacheBudget(fraction=fraction)


@pytest.mark.parametrize("value", ["0", "1", "-0.1", "nan", "inf", "quarter"])
def test_the_fraction_flag_is_a_usage_error_outside_zero_to_one(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings([f"--kv-cache-fraction={value}"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "argument --kv-cache-fraction" in error
    assert "must be above 0 and below 1" in error or "not a number" in error


@pytest.mark.parametrize(
    "flag", ["--kv-cache-bytes=0", "--kv-cache-max-sequences=0", "--block-size=0"]
)
def test_sizes_below_one_are_usage_errors(flag: str) -> None:
    with pytest.raises(SystemExit):
        parse_settings([flag])


def test_the_flags_reach_the_settings() -> None:
    settings = parse_settings(
        ["--kv-cache-fraction=0.3", "--kv-cache-max-sequences=8", "--kv-cache-bytes=4096"]
    )
    assert settings.kv_cache_fraction == 0.3 and settings.kv_cache_max_sequences == 8
    assert settings.kv_cache_bytes == 4096
    defaults = parse_settings([])
    assert defaults.kv_cache_fraction is None and defaults.kv_cache_bytes is None
    assert defaults.kv_cache_max_sequences == DEFAULT_KV_CACHE_MAX_SEQUENCES


def test_a_models_pool_is_sized_from_its_config_and_this_machine(tiny_dir: Path) -> None:
    config = load_model_config(tiny_dir)
    per_block = bytes_per_block(config, 16, torch.float32)
    # K and V, 2 layers, 16 tokens, 2 kv heads of 16 dims, 4 bytes.
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4
    cpu = torch.device("cpu")
    asked = kv_cache_size(config, KVCacheBudget(num_bytes=10 * per_block + 5), cpu, torch.float32)
    assert asked.num_blocks == 10 and asked.available_bytes > 0
    share = kv_cache_size(config, KVCacheBudget(fraction=0.001), cpu, torch.float32)
    assert share.num_blocks > 10 and share.limited_by is not KVCacheLimit.KV_CACHE_BYTES


# --- a real worker's engine -----------------------------------------------------------


def test_a_worker_with_the_defaults_gets_no_more_than_the_cap(tiny_dir: Path) -> None:
    """The tiny model's 64 full contexts (16 MiB) are far below a tenth of any
    machine's memory: the cap binds, and the log line says so."""
    config = load_model_config(tiny_dir)
    with capture_logs() as logs:
        engine = build_engine(_settings(tiny_dir))
    blocks_per_sequence = math.ceil(config.max_position_embeddings / engine.block_size)
    assert engine.num_blocks == DEFAULT_KV_CACHE_MAX_SEQUENCES * blocks_per_sequence
    [line] = [entry for entry in logs if entry["event"] == "kv_cache_sized"]
    assert line["limited_by"] == "max_sequences" and line["num_blocks"] == engine.num_blocks
    assert line["bytes_per_block"] == bytes_per_block(config, engine.block_size, torch.float32)
    assert line["num_bytes"] == engine.num_blocks * line["bytes_per_block"]
    assert line["available_bytes"] > line["num_bytes"] and line["log_level"] == "info"
    assert line["fraction"] == DEFAULT_KV_CACHE_FRACTIONS["cpu"]


def test_a_pool_asked_for_below_one_full_context_starts_with_a_warning(tiny_dir: Path) -> None:
    config = load_model_config(tiny_dir)
    per_block = bytes_per_block(config, 16, torch.float32)
    with capture_logs() as logs:
        engine = build_engine(_settings(tiny_dir, kv_cache_bytes=3 * per_block))
    [line] = [entry for entry in logs if entry["event"] == "kv_cache_sized"]
    assert engine.num_blocks == 3 and line["log_level"] == "warning"
    assert line["limited_by"] == "kv_cache_bytes" and line["max_sequence_tokens"] == 3 * 16
    assert line["num_full_sequences"] == 0


def test_the_packaged_model_with_the_defaults_fits_its_share_and_the_cap(
    prepared_model_dir: Path,
) -> None:
    engine = build_engine(_settings(prepared_model_dir))
    size = engine.kv_cache_size
    config = engine.model.config
    cap = DEFAULT_KV_CACHE_MAX_SEQUENCES * math.ceil(config.max_position_embeddings / 16)
    assert size.num_full_sequences >= 1 and size.num_blocks <= cap
    share = int(DEFAULT_KV_CACHE_FRACTIONS["cpu"] * size.available_bytes)
    assert size.num_bytes <= share or size.limited_by is KVCacheLimit.MAX_SEQUENCES
    print(f"SmolLM2 defaults here: {size.log_fields()}")


def test_a_setting_that_cannot_fit_fails_build_engine_with_its_message(tiny_dir: Path) -> None:
    with pytest.raises(EngineStartFailed, match="cannot hold one sequence"):
        build_engine(_settings(tiny_dir, kv_cache_fraction=1e-12))
    with pytest.raises(EngineStartFailed, match="--kv-cache-fraction must be above 0"):
        build_engine(_settings(tiny_dir, kv_cache_fraction=math.nan))


@pytest.mark.parametrize("engine_thread", [False, True])
def test_the_worker_stops_at_start_with_one_line_and_no_traceback(
    tiny_dir: Path, engine_thread: bool
) -> None:
    flags = ["--engine-thread"] if engine_thread else []
    command = [
        sys.executable, "-m", "gpu_worker", "--model", str(tiny_dir), "--device", "cpu",
        "--redis-url", "redis://127.0.0.1:1", "--no-compile-decode",
        "--kv-cache-fraction", "1e-12", *flags,
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 1
    assert "Traceback" not in finished.stderr
    lines = finished.stderr.strip().splitlines()
    assert lines[-1].startswith("python -m gpu_worker: ")
    assert "cannot hold one sequence" in lines[-1] and "--kv-cache-fraction" in lines[-1]
    if not engine_thread:  # the engine process logs why, without a traceback
        records = [json.loads(line) for line in lines if line.startswith("{")]
        [failed] = [r for r in records if r["event"] == "engine_failed_to_start"]
        assert failed["level"] == "error" and "exception" not in failed
        assert "cannot hold one sequence" in failed["error"]
