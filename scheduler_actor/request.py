"""One request as the scheduler sees it: its progress and where it runs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from shared.messages import FinishReason, SamplingParams

# How a request ended in the scheduler: a worker's finish reason, a cancel, or
# "error" (it failed in a step, or was on too many lost workers; ``error`` says why).
EndReason = FinishReason | Literal["error"]


class RequestStatus(enum.Enum):
    """Where a request is in its life (``placement.py`` moves it between them).

    NEW: just built by ``submit``, in no queue or ledger yet.
    WAITING: in a policy's waiting queue, on no worker. PLACED: on a worker,
    which holds its K/V; it may be inside outstanding plans (``num_inflight``)
    or between iterations. FINISHED: done (or cancelled), possibly held back
    until its batch ends under ``request``.
    """

    NEW = enum.auto()
    WAITING = enum.auto()
    PLACED = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False, slots=True)
class Request:
    """Mutable bookkeeping of one request; only the scheduler core changes it
    (its ``status`` and ``worker_id``: only ``Placements.move``).

    While placed, ``context_ids`` is what the worker prefills (the prompt plus
    the tokens generated before this placement: a recompute), and the
    ``num_*_planned`` counters include every step already planned, whether or
    not its result has returned. ``block_ids`` is its block table on that
    worker (the first ``num_cached_tokens`` slots came from the prefix cache;
    its first ``num_committed_blocks`` blocks are cached).
    """

    request_id: str
    tenant: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_s: float
    arrival_seq: int
    status: RequestStatus = RequestStatus.NEW
    generated_ids: list[int] = field(default_factory=list)
    finish_reason: EndReason | None = None
    error: str = ""  # for finish_reason "error": plain text for the client
    worker_id: str | None = None
    context_ids: list[int] = field(default_factory=list)
    num_prefill_planned: int = 0
    num_decodes_planned: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_committed_blocks: int = 0
    num_inflight: int = 0
    num_iterations: int = 0
    num_preemptions: int = 0
    gateway_id: str = ""
    # Workers lost (heartbeat timeout, re-join after a crash) while it was placed on them.
    num_workers_lost: int = 0
    # Whose cached prefixes it may hit (``prefix_cache.cache_group_of``), and
    # the chain hashes of its full blocks, by block size (computed as needed).
    cache_group: str = ""
    block_hashes: dict[int, list[bytes]] = field(default_factory=dict)
    # When it was first placed on a worker and when its first token came back
    # (the core's clock; None until then, and the first token stays None for a
    # request recovered with tokens already sent): its phases in the metrics.
    first_scheduled_s: float | None = None
    first_token_s: float | None = None

    @property
    def num_blocks(self) -> int:
        """K/V blocks it holds on its worker."""
        return len(self.block_ids)

    @property
    def max_tokens(self) -> int:
        """Most tokens this request may generate."""
        return self.sampling.max_tokens

    @property
    def num_max_context_tokens(self) -> int:
        """Prompt plus max_tokens: the K/V slots reserved when placed up front."""
        return len(self.prompt_ids) + self.sampling.max_tokens

    @property
    def num_tokens_planned(self) -> int:
        """K/V slots the request occupies once every planned step has run."""
        return self.num_prefill_planned + self.num_decodes_planned

    @property
    def is_prefill_planned(self) -> bool:
        """Whether the whole context is in planned steps (its last one samples)."""
        return self.num_prefill_planned == len(self.context_ids)

    @property
    def num_generated_planned(self) -> int:
        """Tokens generated once every planned step has run."""
        num_before = len(self.context_ids) - len(self.prompt_ids)
        return num_before + int(self.is_prefill_planned) + self.num_decodes_planned

    def can_continue(self, max_plans: int) -> bool:
        """Whether a next step may be planned now: inside fewer than
        ``max_plans`` outstanding plans (1: between iterations only; more:
        overlap, the worker runs plans in order, so it knows the effect of
        every earlier one before it runs the next)."""
        return self.num_inflight < max_plans

    def wants_decode(self) -> bool:
        """Prefill planned and max_tokens not yet reached by planned steps: the
        request is certainly still running unless it stops on a stop token."""
        # num_generated_planned once the prefill is planned, inlined: this runs
        # for every placed request in every step.
        num_context_tokens = len(self.context_ids)
        return self.num_prefill_planned == num_context_tokens and (
            num_context_tokens - len(self.prompt_ids) + 1 + self.num_decodes_planned
            < self.sampling.max_tokens
        )

    def wants_prefill(self) -> bool:
        """Part of the context is still to be planned."""
        return self.num_prefill_planned < len(self.context_ids)


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What the scheduler reports when a request's result is released."""

    request_id: str
    tenant: str
    token_ids: list[int]
    finish_reason: EndReason
    arrival_s: float
    finish_s: float
    num_preemptions: int
    error: str = ""  # why, for finish_reason "error"
    gateway_id: str = ""  # where the request was served when it ended
    num_prompt_tokens: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
