"""A stage's wires to its neighbours in a worker group, over ``torch.distributed``.

Two process groups of the same ranks: the world carries each step's
``StageStep`` and then its hidden states from stage to stage (gloo);
a second gloo group carries the last stage's ``StageResult`` back to the
first, so the first stage's thread that waits for results never shares a
group with the sends of its main thread.

A message is its length (one int64) then its bytes (uint8). A stage's hidden
states go as a header (float64: 1, or 0 when its forward failed and nothing
follows; then each stage's compute time so far, in ms) then the residual
stream's two halves stacked, ``[2, T, hidden]``, through host memory (gloo's
point-to-point takes CPU tensors; NCCL for a CUDA group is not built yet). A
peer that dies breaks the connection: the waiting call raises (gloo), and the
stage ends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class StageLink:
    """Sends and receives of one rank of a pipeline of ``world_size`` stages."""

    def __init__(self, rank: int, world_size: int, result_group: dist.ProcessGroup) -> None:
        self.rank = rank
        self.world_size = world_size
        self.result_group = result_group

    @property
    def previous(self) -> int:
        """The stage before this one."""
        return self.rank - 1

    @property
    def next(self) -> int:
        """The stage after this one."""
        return self.rank + 1

    @property
    def last(self) -> int:
        """The last stage, which samples."""
        return self.world_size - 1

    def send_message(self, payload: bytes, dst: int, results: bool = False) -> None:
        """``payload`` to rank ``dst`` (on the results group when ``results``)."""
        group = self.result_group if results else None
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst, group=group)
        if len(payload):
            dist.send(data, dst, group=group)

    def recv_message(self, src: int, results: bool = False) -> bytes:
        """The next message from rank ``src``."""
        group = self.result_group if results else None
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        if len(data):
            dist.recv(data, src, group=group)
        return data.numpy().tobytes()

    def send_hidden(self, carried: torch.Tensor | None, stage_ms: list[float], dst: int) -> None:
        """The residual stream (None: this stage's forward failed) to rank ``dst``,
        after how long each stage so far computed it (ms, one per stage)."""
        header = torch.tensor([0.0 if carried is None else 1.0, *stage_ms], dtype=torch.float64)
        dist.send(header, dst)
        if carried is not None:
            dist.send(carried.cpu().contiguous(), dst)

    def recv_hidden(
        self, src: int, num_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, list[float]]:
        """The residual stream of a step of ``num_tokens`` from rank ``src`` (None: a
        stage before failed), and how long each stage before this one computed it."""
        header = torch.empty(1 + self.rank, dtype=torch.float64)
        dist.recv(header, src)
        flag, *stage_ms = header.tolist()
        if not flag:
            return None, stage_ms
        carried = torch.empty((2, num_tokens, hidden_size), dtype=dtype)
        dist.recv(carried, src)
        return carried, stage_ms
