"""A worker group's layout: which ranks run on this host, where they meet, and
which layers each pipeline stage runs (no torch here: the worker's shell reads it).

A group of P stages splits the decoder's layers into P runs of consecutive
layers: balanced by count by default (the first stages take one more where
they do not divide), or as ``--layer-split`` says (P counts, each at least
one, adding up to the model's layers). The first stage also holds the
embeddings; the last one the final norm, the LM head and the sampler.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from shared.settings import WorkerSettings


class GroupConfigError(ValueError):
    """A worker group that cannot be made as asked; the message names the numbers."""


def parse_layer_split(text: str) -> tuple[int, ...]:
    """``"15,15"`` -> (15, 15); GroupConfigError for anything but positive integers."""
    parts = [part.strip() for part in text.split(",")]
    try:
        counts = tuple(int(part) for part in parts)
    except ValueError:
        raise GroupConfigError(
            f"--layer-split takes the layers of each stage as integers, like 15,15; got {text!r}"
        ) from None
    if any(count < 1 for count in counts):
        raise GroupConfigError(
            f"every stage of --layer-split needs at least one layer; got {text!r}"
        )
    return counts


def stage_layer_ranges(
    num_layers: int, num_stages: int, layer_split: Sequence[int] | None = None
) -> list[range]:
    """The layers of each of ``num_stages`` stages, in order."""
    if num_stages < 1:
        raise GroupConfigError(f"--pipeline-parallel must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise GroupConfigError(
            f"--pipeline-parallel {num_stages} is more stages than the model's {num_layers} "
            "layers: each stage needs at least one"
        )
    if layer_split is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if stage < extra else 0) for stage in range(num_stages)]
    else:
        counts = list(layer_split)
        if len(counts) != num_stages:
            raise GroupConfigError(
                f"--layer-split names {len(counts)} stages but --pipeline-parallel is {num_stages}"
            )
        if sum(counts) != num_layers:
            raise GroupConfigError(
                f"--layer-split {','.join(map(str, counts))} adds up to {sum(counts)} layers; "
                f"the model has {num_layers}"
            )
    ranges = []
    start = 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 free now (the rendezvous of a group on this host)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rendezvous_address(text: str | None) -> tuple[str, int]:
    """HOST and PORT of a ``--rendezvous``; GroupConfigError where it is not one."""
    text = text or ""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise GroupConfigError(f"--rendezvous takes HOST:PORT, got {text!r}")
    return host, int(port)


def world_size(settings: WorkerSettings) -> int:
    """Ranks of the group: its stages times the tensor-parallel ranks of each."""
    return settings.pipeline_parallel * settings.tensor_parallel


def local_ranks(settings: WorkerSettings) -> list[int]:
    """The ranks this host runs: all of them, or the one of ``--group-rank``."""
    if settings.group_rank is None:
        return list(range(world_size(settings)))
    return [settings.group_rank]


def num_local_ranks(settings: WorkerSettings) -> int:
    """Ranks sharing this host's memory (and cores)."""
    if settings.local_ranks is not None:
        return settings.local_ranks
    return len(local_ranks(settings))
