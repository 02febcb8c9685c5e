"""A worker group's layout and flags: the layers of each stage, and every way of
asking for a group that cannot be made, refused at start with the numbers."""

from __future__ import annotations

import pytest

from gpu_worker.__main__ import parse_settings
from gpu_worker.pipeline_layout import (
    GroupConfigError,
    parse_layer_split,
    rendezvous_address,
    stage_layer_ranges,
)


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "split", "expected"),
    [
        (30, 1, None, [range(0, 30)]),
        (30, 2, None, [range(0, 15), range(15, 30)]),
        (30, 4, None, [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]),
        (2, 2, None, [range(0, 1), range(1, 2)]),
        (30, 2, (20, 10), [range(0, 20), range(20, 30)]),
    ],
)
def test_each_stage_takes_a_run_of_consecutive_layers(num_layers, num_stages, split, expected):
    assert stage_layer_ranges(num_layers, num_stages, split) == expected


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "split", "message"),
    [
        (30, 0, None, "at least 1, got 0"),
        (30, -2, None, "at least 1, got -2"),
        (30, 31, None, "31 is more stages than the model's 30 layers"),
        (30, 2, (10, 10), "adds up to 20 layers; the model has 30"),
        (30, 3, (15, 15), "names 2 stages but --pipeline-parallel is 3"),
    ],
)
def test_a_group_that_cannot_be_split_is_refused(num_layers, num_stages, split, message):
    with pytest.raises(GroupConfigError, match=message):
        stage_layer_ranges(num_layers, num_stages, split)


@pytest.mark.parametrize("text", ["15,x", "15.5,14.5", "0,30", "-1,31", "", "15,,15"])
def test_a_layer_split_takes_positive_integers_only(text):
    with pytest.raises(GroupConfigError, match="--layer-split"):
        parse_layer_split(text)


@pytest.mark.parametrize("text", [None, "host", "host:", ":29500", "host:0", "host:70000", "h:p"])
def test_a_rendezvous_is_host_and_port(text):
    with pytest.raises(GroupConfigError, match="HOST:PORT"):
        rendezvous_address(text)
    assert rendezvous_address("10.0.0.2:29500") == ("10.0.0.2", 29500)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pipeline-parallel", "0"], "must be >= 1, got 0"),
        (["--pipeline-parallel", "-1"], "must be >= 1, got -1"),
        (["--pipeline-parallel", "1.5"], "not an integer"),
        (["--pipeline-parallel", "two"], "not an integer"),
        (["--pipeline-parallel", "2", "--layer-split", "10,x"], "--layer-split takes"),
        (["--pipeline-parallel", "2", "--layer-split", "10,10,10"], "names 3 stages"),
        (["--pipeline-parallel", "2", "--engine-thread"], "runs its engines in processes"),
        (["--pipeline-parallel", "2", "--group-rank", "2", "--rendezvous", "h:1"], "outside"),
        (["--pipeline-parallel", "2", "--group-rank", "1"], "needs --rendezvous"),
        (["--pipeline-parallel", "2", "--rendezvous", "nohost"], "HOST:PORT"),
        (["--rendezvous-timeout-s", "nan"], "rendezvous-timeout-s"),
        (["--rendezvous-timeout-s", "0"], "rendezvous-timeout-s"),
    ],
)
def test_bad_group_flags_are_refused_with_a_clear_message(argv, message, capsys, monkeypatch):
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_torch_distributed_launch_variables_place_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    settings = parse_settings(["--pipeline-parallel", "2"])
    assert (settings.group_rank, settings.rendezvous, settings.local_ranks) == (
        1,
        "10.0.0.2:29500",
        1,
    )
    assert parse_settings([]).pipeline_parallel == 1
