"""A rank's wires to the rest of its worker group, over ``torch.distributed``.

Rank r is tensor rank ``r % T`` of pipeline stage ``r // T``; a stage's tensor
rank 0 is its leader. Two planes, as in Orca: the control plane (gloo, host
memory, never the device) carries each step's ``StageStep`` from leader to
leader, the header of its hidden states, and the last stage's
``StageResult`` back to rank 0 on a group of its own (so the first stage's
thread that waits for results never shares a group with the sends of its
stage thread); the data plane (the world group: NCCL on CUDA, gloo on the
CPU, ``data_backend``) carries the hidden states, on the device, and the
tensor ranks' all-reduces. A leader shares what it receives with its stage's
other tensor ranks by broadcast: the message on the stage's control group,
the hidden states on its data group.

A message is its length (one int64) then its bytes (uint8). A stage's hidden
states go as a header (float64 on the control plane: 1, or 0 when a forward
failed and nothing follows; then each stage's compute time so far, in ms)
then the residual stream's two halves stacked, ``[2, T, hidden]``, on the
data plane. On CUDA a send is queued behind the kernels that make its tensor
(NCCL's stream waits for the compute stream) and a receive makes the compute
stream wait, not the host: a stage issues its step and goes on
(forward-on-issue). A peer that dies breaks the connection: the waiting call
raises, and the rank ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist


def data_backend(device: torch.device) -> str:
    """The data plane's backend for a group whose tensors live on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class LinkGroups:
    """A rank's process groups besides the world group (the data plane between
    stages): every rank makes them all, in the same order (``new_group``'s rule)."""

    control: dist.ProcessGroup  # gloo: steps and headers, leader to leader
    results: dist.ProcessGroup  # gloo: the last stage's answers to rank 0
    stage_data: dist.ProcessGroup | None = None  # the stage's ranks: all-reduces, hidden states
    stage_control: dist.ProcessGroup | None = None  # gloo: the stage's messages


class StageLink:
    """Sends and receives of one rank of ``num_stages`` stages of ``tensor_parallel`` ranks,
    whose tensors live on ``device``."""

    def __init__(
        self,
        rank: int,
        num_stages: int,
        tensor_parallel: int,
        groups: LinkGroups,
        device: torch.device,
    ) -> None:
        self.rank = rank
        self.num_stages = num_stages
        self.tensor_parallel = tensor_parallel
        self.groups = groups
        self.device = device
        self.stage = rank // tensor_parallel
        self.leader = self.stage * tensor_parallel
        self._pending_sends: deque[tuple[dist.Work, torch.Tensor]] = deque()

    @property
    def is_leader(self) -> bool:
        """Whether this rank talks to the stages before and after."""
        return self.rank == self.leader

    @property
    def previous(self) -> int:
        """The leader of the stage before."""
        return self.leader - self.tensor_parallel

    @property
    def next(self) -> int:
        """The leader of the stage after."""
        return self.leader + self.tensor_parallel

    @property
    def last(self) -> int:
        """The leader of the last stage, which samples."""
        return (self.num_stages - 1) * self.tensor_parallel

    def send_message(self, payload: bytes, dst: int, results: bool = False) -> None:
        """``payload`` to rank ``dst`` (on the results group when ``results``), without
        waiting for ``dst`` to take it."""
        group = self.groups.results if results else self.groups.control
        self._send(torch.tensor([len(payload)], dtype=torch.int64), dst, group)
        if payload:
            self._send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst, group)

    def _send(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
        """Post a send and go on: gloo's send waits until the peer has posted its
        receive, so a stage that sent the next step (or its hidden states) to a
        stage still computing the last one would wait for it: lock-step, no
        pipeline. Sends to one peer arrive in order; the tensor is kept until its
        send is done, and a send that failed raises at the next one."""
        pending = self._pending_sends
        while pending and pending[0][0].is_completed():
            done, _ = pending.popleft()
            done.wait()  # raises if the send failed (the peer is gone)
        posted = dist.isend(tensor, dst, group=group)
        assert posted is not None
        pending.append((posted, tensor))

    def wait_sent(self) -> None:
        """Until every send posted is done (before the rank ends)."""
        while self._pending_sends:
            work, _ = self._pending_sends.popleft()
            work.wait()

    def recv_message(self, src: int, results: bool = False) -> bytes:
        """The next message from rank ``src``."""
        group = self.groups.results if results else self.groups.control
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        if len(data):
            dist.recv(data, src, group=group)
        return data.numpy().tobytes()

    def share_message(self, payload: bytes | None) -> bytes:
        """The leader's ``payload`` on every rank of the stage (others pass None)."""
        group = self.groups.stage_control
        if group is None:
            assert payload is not None
            return payload
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, self.leader, group=group)
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        if len(data):
            dist.broadcast(data, self.leader, group=group)
        return data.numpy().tobytes()

    def send_hidden(self, carried: torch.Tensor | None, stage_ms: list[float], dst: int) -> None:
        """The residual stream (None: a forward failed) to rank ``dst``, after how
        long each stage so far computed it (ms, one per stage)."""
        header = torch.tensor([0.0 if carried is None else 1.0, *stage_ms], dtype=torch.float64)
        self._send(header, dst, self.groups.control)
        if carried is not None:
            self._send(carried.to(self.device).contiguous(), dst, None)

    def recv_hidden(
        self, src: int, num_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, list[float]]:
        """The residual stream of a step of ``num_tokens`` from rank ``src`` (None: a
        forward failed before), and how long each stage before this one computed it."""
        header = torch.empty(1 + self.stage, dtype=torch.float64)
        dist.recv(header, src, group=self.groups.control)
        flag, *stage_ms = header.tolist()
        if not flag:
            return None, stage_ms
        carried = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=self.device)
        dist.recv(carried, src)
        return carried, stage_ms

    def share_hidden(
        self, carried: torch.Tensor | None, num_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The leader's residual stream (None: a forward failed) on every rank of the
        stage; the others pass None."""
        if self.groups.stage_data is None:
            return carried
        flag = torch.tensor([1 if carried is not None else 0], dtype=torch.int64)
        if not self.is_leader:
            flag = torch.empty(1, dtype=torch.int64)
        dist.broadcast(flag, self.leader, group=self.groups.stage_control)
        if not int(flag.item()):
            return None
        if carried is None:
            carried = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=self.device)
        else:
            carried = carried.to(self.device).contiguous()
        dist.broadcast(carried, self.leader, group=self.groups.stage_data)
        return carried

    def reduce_partial(self, partial: torch.Tensor) -> None:
        """A row-parallel product's partial sums added up across the stage's ranks, in place."""
        assert self.groups.stage_data is not None
        dist.all_reduce(partial, group=self.groups.stage_data)
