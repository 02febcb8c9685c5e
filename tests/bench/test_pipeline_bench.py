"""``bench/pipeline.py``'s choice of servers: the ones ``--servers`` names, in the
table's order, plus a group for each ``--layer-splits`` entry; an unknown name
is refused with the known ones."""

from __future__ import annotations

import pytest

from bench.pipeline import SERVER_KEYS, _parser, orcapod_servers


def test_servers_are_the_ones_named_plus_one_group_a_layer_split() -> None:
    args = _parser().parse_args(["--servers", "group,one", "--layer-splits", "16,14/17,13"])
    assert orcapod_servers(args) == {
        "orcapod, one engine": [],
        "orcapod, 2 stages": ["--pipeline-parallel", "2"],
        "orcapod, 2 stages, --layer-split 16,14": [
            "--pipeline-parallel", "2", "--worker-arg=--layer-split=16,14",
        ],
        "orcapod, 2 stages, --layer-split 17,13": [
            "--pipeline-parallel", "2", "--worker-arg=--layer-split=17,13",
        ],
    }  # fmt: skip
    every = orcapod_servers(_parser().parse_args([]))
    assert len(every) == len(SERVER_KEYS)


def test_an_unknown_server_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(SystemExit, match=r"'groups'.*one,group,per-stage"):
        orcapod_servers(_parser().parse_args(["--servers", "groups"]))
