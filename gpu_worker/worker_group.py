"""A worker group: one model split into pipeline stages, one engine rank each,
joined over ``torch.distributed`` (NCCL on CUDA, gloo on the CPU).

Every rank reads only its share of the model (``weight_share.py``: its
stage's layers, ``pipeline_layout.py``, cut to its tensor rank's part) and
sizes its K/V pool; then the ranks meet at rank 0's
``TCPStore`` (the rendezvous: ``--rendezvous HOST:PORT``, or a free port on
127.0.0.1 when every rank runs on this host). Rank 0 checks that every rank
came within the timeout (naming those that did not), that all loaded the
same model the same way (its shape, dtype, weight format, a digest of its
checkpoint, the split) and takes the smallest pool: every stage holds every
block the scheduler may grant. Then the ranks start their process groups: the
data plane (NCCL on CUDA, one GPU a rank; gloo on the CPU) and gloo's control
plane (``pipeline_link.py``).
Anything wrong ends every rank at start with one message.

Rank 0 is the group's only Redis client (its shell); the stages behind it
run ``serve_stage`` and need nothing but the group.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from dataclasses import dataclass

import msgspec
import structlog
import torch
import torch.distributed as dist

from gpu_worker.device import choose_device
from gpu_worker.kv_cache import KVCacheBudget, KVCacheSize, KVCacheSizeError, kv_cache_size
from gpu_worker.llama import LlamaModel
from gpu_worker.model_config import ModelConfig, load_model_config
from gpu_worker.pipeline_layout import (
    GroupConfigError,
    local_ranks,
    num_local_ranks,
    rendezvous_address,
    stage_layer_ranges,
    world_size,
)
from gpu_worker.pipeline_link import LinkGroups, StageLink, data_backend
from gpu_worker.tensor_shard import check_tensor_parallel
from gpu_worker.weight_share import WeightShare
from gpu_worker.weights import checkpoint_digest
from shared.settings import WorkerSettings, default_kv_cache_fraction

_log = structlog.get_logger(__name__)

_KEY = "orcapod/group/"
# How long rank 0 waits, having refused the group, for the others to read why.
_REFUSAL_READ_S = 5.0


class GroupStartError(RuntimeError):
    """The group cannot start; the message says why (the same on every rank)."""


class _RankReport(msgspec.Struct, frozen=True):
    """What each rank tells rank 0 once its model is loaded: what it loaded, the
    blocks its pool can hold, or why it could not."""

    model: str = ""
    num_blocks: int = 0
    error: str = ""


class _Verdict(msgspec.Struct, frozen=True):
    """Rank 0's answer: the group's pool in blocks, or why the group cannot start."""

    num_blocks: int = 0
    error: str = ""


def model_fingerprint(
    config: ModelConfig, dtype: torch.dtype, weight_format: str, settings: WorkerSettings
) -> str:
    """What every rank must agree on: the model's shape, dtype, weight format, a digest
    of its checkpoint, and the group's split."""
    return (
        f"{config} dtype={dtype} weights={weight_format} "
        f"pipeline_parallel={settings.pipeline_parallel} layer_split={settings.layer_split} "
        f"tensor_parallel={settings.tensor_parallel} "
        f"digest={checkpoint_digest(settings.model.model_dir)}"
    )


@dataclass
class GroupMember:
    """One rank of a started group: its stage's model, the group's pool size, its wires."""

    rank: int
    world_size: int
    layers: range
    model: LlamaModel
    kv_size: KVCacheSize
    link: StageLink

    @property
    def first(self) -> bool:
        """Whether this rank's stage embeds the tokens (its leader, rank 0, talks to
        the shell)."""
        return self.link.stage == 0

    @property
    def last(self) -> bool:
        """Whether this rank's stage is the last (its leader samples)."""
        return self.link.stage == self.link.num_stages - 1


def _stage_budget(settings: WorkerSettings, device: torch.device) -> KVCacheBudget:
    """The K/V budget of one rank: the worker's; on the CPU its memory share divided
    among the ranks of this host (three ranks must not each take the whole share)."""
    fraction = settings.kv_cache_fraction
    if settings.kv_cache_bytes is None:
        fraction = fraction or default_kv_cache_fraction(device.type)
        if device.type == "cpu":  # on CUDA each rank has a device of its own
            fraction /= num_local_ranks(settings)
    return KVCacheBudget(
        num_bytes=settings.kv_cache_bytes,
        fraction=fraction,
        block_size=settings.block_size,
        max_sequences=settings.kv_cache_max_sequences,
    )


def rank_share(config: ModelConfig, settings: WorkerSettings, rank: int) -> WeightShare:
    """What rank ``rank`` holds of the model (raises GroupConfigError for a split
    the model does not allow): its stage's layers, cut to its tensor rank's share;
    a stage's other tensor ranks leave the LM head and the sampling to its leader."""
    ranges = stage_layer_ranges(config.num_layers, settings.pipeline_parallel, settings.layer_split)
    check_tensor_parallel(config, settings.tensor_parallel)
    stage, tensor_rank = divmod(rank, settings.tensor_parallel)
    return WeightShare(
        layers=ranges[stage],
        embeddings=stage == 0,
        head=stage == settings.pipeline_parallel - 1 and tensor_rank == 0,
        tensor_parallel=settings.tensor_parallel,
        tensor_rank=tensor_rank,
    )


def rank_device(settings: WorkerSettings, rank: int) -> str:
    """Rank ``rank``'s device: ``--device`` where it is the CPU or names an index,
    else on CUDA the GPU of the rank's place among this host's ranks (torchrun's
    ``LOCAL_RANK`` where set): NCCL takes one device a rank, so a host with fewer
    GPUs than ranks is refused (GroupConfigError)."""
    device = choose_device(settings.device)
    if device.type != "cuda" or device.index is not None:
        return str(device)
    local = int(os.environ.get("LOCAL_RANK", local_ranks(settings).index(rank)))
    count = torch.cuda.device_count()
    if local >= count:
        raise GroupConfigError(
            f"rank {rank} is rank {local} of this host, which has {count} CUDA device(s): "
            "a group's ranks on CUDA take one device each (NCCL); run at most "
            f"{count} ranks a host, or give each its --device cuda:N"
        )
    return f"cuda:{local}"


def _load_stage(settings: WorkerSettings, rank: int) -> tuple[range, LlamaModel, KVCacheSize, str]:
    """This rank's layers, share of the model (read alone: ``weight_share``), pool
    size and fingerprint (raises GroupConfigError or KVCacheSizeError for a setting
    to change)."""
    from gpu_worker.model_loading import load_model
    from gpu_worker.quantized_linear import weight_format_of

    model_dir = settings.model.model_dir
    config = load_model_config(model_dir)
    share = rank_share(config, settings, rank)
    device = rank_device(settings, rank)
    model = load_model(model_dir, device, settings.dtype, settings.weight_format, share)
    fingerprint = model_fingerprint(config, model.dtype, weight_format_of(model.weights), settings)
    budget = _stage_budget(settings, model.device)
    size = kv_cache_size(model.config, budget, model.device, model.dtype)
    return share.layers, model, size, fingerprint


def _connect(settings: WorkerSettings, rank: int) -> dist.TCPStore:
    host, port = rendezvous_address(settings.rendezvous)
    timeout = datetime.timedelta(seconds=settings.rendezvous_timeout_s)
    try:
        return dist.TCPStore(
            host, port, world_size(settings), is_master=rank == 0,
            timeout=timeout, wait_for_workers=False,
        )  # fmt: skip
    except Exception as error:  # refused, unreachable, timed out: the rendezvous is not there
        raise GroupStartError(
            f"rank {rank} could not reach the group's rendezvous at {host}:{port} within "
            f"{settings.rendezvous_timeout_s:g} s ({error})"
        ) from None


def _judge(store: dist.TCPStore, settings: WorkerSettings) -> _Verdict:
    """Rank 0: every rank's report within the timeout, the same model, the smallest pool."""
    world = world_size(settings)
    keys = [f"{_KEY}report/{rank}" for rank in range(world)]
    deadline = time.monotonic() + settings.rendezvous_timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
            return _Verdict(
                error=f"ranks {missing} of the group's {world} never joined the rendezvous "
                f"at {settings.rendezvous} within {settings.rendezvous_timeout_s:g} s"
            )
        time.sleep(0.05)
    reports = [msgspec.json.decode(store.get(key), type=_RankReport) for key in keys]
    for rank, report in enumerate(reports):
        if report.error:
            return _Verdict(error=f"rank {rank} could not start: {report.error}")
    for rank, report in enumerate(reports[1:], start=1):
        if report.model != reports[0].model:
            return _Verdict(
                error=f"rank {rank} loaded another model than rank 0: {report.model!r} against "
                f"{reports[0].model!r}"
            )
    return _Verdict(num_blocks=min(report.num_blocks for report in reports))


def join_group(settings: WorkerSettings, rank: int) -> GroupMember:
    """Load this rank's stage, meet the others, and start the process groups;
    GroupStartError (on every rank alike) where the group cannot start."""
    world = world_size(settings)
    if not 0 <= rank < world:
        raise GroupStartError(f"--group-rank {rank} is outside the group's ranks 0 to {world - 1}")
    if num_local_ranks(settings) > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one host share its cores: one stage's threads on cores of their own.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_local_ranks(settings)))
    store = _connect(settings, rank)
    try:
        layers, model, size, fingerprint = _load_stage(settings, rank)
        report = _RankReport(model=fingerprint, num_blocks=size.num_blocks)
    except (GroupConfigError, KVCacheSizeError) as error:
        layers, model, size, report = range(0), None, None, _RankReport(error=str(error))
    except Exception as error:  # a model that does not load: every rank is told
        _log.exception("group_rank_failed_to_load", rank=rank)
        layers, model, size, report = range(0), None, None, _RankReport(error=str(error))
    store.set(f"{_KEY}report/{rank}", msgspec.json.encode(report).decode())
    if rank == 0:
        verdict = _judge(store, settings)
        store.set(f"{_KEY}verdict", msgspec.json.encode(verdict).decode())
    else:
        try:
            store.wait([f"{_KEY}verdict"])
        except Exception:
            raise GroupStartError(
                f"rank {rank}: rank 0 gave no answer within {settings.rendezvous_timeout_s:g} s"
            ) from None
        verdict = msgspec.json.decode(store.get(f"{_KEY}verdict"), type=_Verdict)
        store.set(f"{_KEY}read/{rank}", "1")
    if verdict.error:
        if rank == 0:  # the store lives here: let the ranks that came read why first
            came = [r for r in range(1, world) if store.check([f"{_KEY}report/{r}"])]
            readers = [f"{_KEY}read/{r}" for r in came]
            deadline = time.monotonic() + _REFUSAL_READ_S
            while not store.check(readers) and time.monotonic() < deadline:
                time.sleep(0.05)
        raise GroupStartError(verdict.error)
    assert model is not None and size is not None
    timeout = datetime.timedelta(seconds=settings.rendezvous_timeout_s)
    device = model.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The world group is the data plane (NCCL on CUDA); the control plane is gloo's.
    dist.init_process_group(
        data_backend(device), store=dist.PrefixStore(f"{_KEY}pg", store), rank=rank,
        world_size=world, timeout=timeout,
    )  # fmt: skip
    control = dist.new_group(backend="gloo", timeout=timeout)
    results = dist.new_group(backend="gloo", timeout=timeout)
    # Every rank makes every stage's groups, in the same order (new_group's rule).
    tensor_parallel = settings.tensor_parallel
    groups = LinkGroups(control, results)
    if tensor_parallel > 1:
        for start in range(0, world, tensor_parallel):
            ranks = list(range(start, start + tensor_parallel))
            stage_data = dist.new_group(ranks, timeout, data_backend(device))
            stage_control = dist.new_group(ranks, timeout, "gloo")
            if start == rank // tensor_parallel * tensor_parallel:
                groups = LinkGroups(control, results, stage_data, stage_control)
    link = StageLink(rank, settings.pipeline_parallel, tensor_parallel, groups, device)
    if groups.stage_data is not None:
        model.reduce_partial = link.reduce_partial
    _log.info(
        "group_rank_joined", rank=rank, world_size=world, pid=os.getpid(),
        layers=f"{layers.start}-{layers.stop - 1}", num_blocks=verdict.num_blocks,
        threads=torch.get_num_threads(), device=str(device),
    )  # fmt: skip
    return GroupMember(
        rank=rank,
        world_size=world,
        layers=layers,
        model=model,
        kv_size=dataclasses.replace(size, num_blocks=verdict.num_blocks),
        link=link,
    )
