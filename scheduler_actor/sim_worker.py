"""A simulated GPU worker: executes StepPlans on counters instead of a model.

It follows the worker's side of shared/messages.py exactly (releases, then
registrations, then block grants, then chunks and decodes; a token is sampled
after the chunk that completes the prompt and after each decode; a decode of
a finished request is skipped; a finished request's table is forgotten). It
keeps the token written in every slot of every block, and raises
SimulatedWorkerError on any plan that breaks the protocol: a block out of
range, a write outside the granted blocks or into a block another running
request holds, a cached prefix whose blocks do not hold the request's tokens
(checked against ``expected_tokens`` when given). The simulator and the
property tests use it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from scheduler_actor.cost_model import CostModel
from shared.messages import FinishReason, SampledToken, StepOutput, StepPlan

# The step path its outputs name (a real worker's: gpu_worker/step_path.py).
SIMULATED_PATH = "simulated"


class SimulatedWorkerError(AssertionError):
    """A plan broke the worker protocol or the worker's K/V budget."""


@dataclass(slots=True)
class _Sequence:
    num_prompt_tokens: int
    num_generated: int
    max_tokens: int
    num_kv_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    last_token_id: int = -1


class SimulatedWorker:
    """Executes plans one after another; ``stop_indices`` makes a request stop
    (finish "stop") when it samples that generation index."""

    def __init__(
        self,
        worker_id: str,
        num_blocks: int,
        block_size: int,
        cost_model: CostModel,
        stop_indices: Mapping[str, int] | None = None,
        expected_tokens: Callable[[str], list[int]] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._cost_model = cost_model
        self._stop_indices = stop_indices or {}
        self._expected_tokens = expected_tokens
        self._sequences: dict[str, _Sequence] = {}
        # The token whose K/V each slot holds (-1: never written).
        self._slots = [-1] * (num_blocks * block_size)
        self.num_steps = 0
        self.num_cached_tokens = 0  # prompt tokens it was told are cached, all requests

    @property
    def num_used_blocks(self) -> int:
        """Distinct blocks in the tables of live sequences."""
        return len({b for sequence in self._sequences.values() for b in sequence.block_ids})

    def execute(self, plan: StepPlan) -> tuple[StepOutput, float]:
        """Run one plan; returns its output and simulated duration in seconds."""
        if plan.worker_id != self.worker_id:
            raise SimulatedWorkerError(f"plan for {plan.worker_id} sent to {self.worker_id}")
        for request_id in plan.released_request_ids:
            self._sequences.pop(request_id, None)
        for spec in plan.new_requests:
            if spec.request_id in self._sequences:
                raise SimulatedWorkerError(f"{spec.request_id} registered twice")
            self._sequences[spec.request_id] = _Sequence(
                spec.num_prompt_tokens,
                spec.num_generated,
                spec.sampling.max_tokens,
                num_kv_tokens=spec.num_cached_tokens,
            )
        for request_id, block_ids in plan.block_grants.items():
            if any(not 0 <= block_id < self.num_blocks for block_id in block_ids):
                raise SimulatedWorkerError(f"{request_id} granted a block out of range")
            if request_id in self._sequences:
                self._sequences[request_id].block_ids += block_ids
        for spec in plan.new_requests:
            self._check_cached_prefix(spec.request_id, spec.num_cached_tokens)
        holders = Counter(b for sequence in self._sequences.values() for b in sequence.block_ids)
        tokens: list[SampledToken] = []
        num_new_tokens = 0
        num_attended = 0
        for chunk in plan.prefill_chunks:
            sequence = self._sequences.get(chunk.request_id)
            if sequence is None or chunk.start_position != sequence.num_kv_tokens:
                raise SimulatedWorkerError(f"chunk of {chunk.request_id} out of place")
            num = len(chunk.token_ids)
            if num == 0 or sequence.num_kv_tokens + num > sequence.num_prompt_tokens:
                raise SimulatedWorkerError(f"chunk of {chunk.request_id} has a bad length")
            num_attended += num * sequence.num_kv_tokens + num * (num + 1) // 2
            self._write(chunk.request_id, sequence, chunk.token_ids, holders)
            num_new_tokens += num
            if sequence.num_kv_tokens == sequence.num_prompt_tokens:
                tokens.append(self._sample(chunk.request_id, sequence))
        for request_id in plan.decode_request_ids:
            sequence = self._sequences.get(request_id)
            if sequence is None:
                continue  # finished at an earlier step (overlap) or released
            if sequence.num_kv_tokens < sequence.num_prompt_tokens:
                raise SimulatedWorkerError(f"decode of {request_id} before its prompt ran")
            self._write(request_id, sequence, [sequence.last_token_id], holders)
            num_attended += sequence.num_kv_tokens
            num_new_tokens += 1
            tokens.append(self._sample(request_id, sequence))
        # The worker forgets a finished request's table at the end of the step.
        for token in tokens:
            if token.finish_reason is not None:
                del self._sequences[token.request_id]
        self.num_steps += 1
        step_s = self._cost_model.step_s(num_new_tokens, num_attended)
        output = StepOutput(
            worker_id=self.worker_id,
            epoch=plan.epoch,
            step_index=plan.step_index,
            tokens=tokens,
            num_new_tokens=num_new_tokens,
            step_ms=step_s * 1000.0,
            path=SIMULATED_PATH,
        )
        return output, step_s

    def _check_cached_prefix(self, request_id: str, num_cached_tokens: int) -> None:
        """A request admitted after a cached prefix: its granted blocks hold it."""
        if not num_cached_tokens:
            return
        self.num_cached_tokens += num_cached_tokens
        sequence = self._sequences[request_id]
        size = self.block_size
        if num_cached_tokens % size or num_cached_tokens > len(sequence.block_ids) * size:
            raise SimulatedWorkerError(
                f"{request_id}: {num_cached_tokens} cached tokens off blocks"
            )
        cached = [
            self._slots[block_id * size + offset]
            for block_id in sequence.block_ids[: num_cached_tokens // size]
            for offset in range(size)
        ]
        if -1 in cached:
            raise SimulatedWorkerError(f"{request_id}: its cached prefix was never written")
        if self._expected_tokens is not None:
            expected = self._expected_tokens(request_id)[:num_cached_tokens]
            if cached != expected:
                raise SimulatedWorkerError(f"{request_id}: its cached prefix holds other tokens")

    def _write(
        self, request_id: str, sequence: _Sequence, token_ids: list[int], holders: Counter[int]
    ) -> None:
        """Write K/V for the next positions of the sequence, into its own blocks only."""
        size = self.block_size
        for token_id in token_ids:
            position = sequence.num_kv_tokens
            if position // size >= len(sequence.block_ids):
                raise SimulatedWorkerError(f"{request_id} writes past its granted blocks")
            block_id = sequence.block_ids[position // size]
            if holders[block_id] > 1:
                raise SimulatedWorkerError(f"{request_id} writes into block {block_id}, shared")
            self._slots[block_id * size + position % size] = token_id
            sequence.num_kv_tokens += 1

    def _sample(self, request_id: str, sequence: _Sequence) -> SampledToken:
        index = sequence.num_generated
        sequence.num_generated += 1
        reason: FinishReason | None = None
        if index + 1 >= sequence.max_tokens:
            reason = "length"
        elif self._stop_indices.get(request_id) == index:
            reason = "stop"
        # A token id derived from the position, so a recompute can be checked.
        sequence.last_token_id = 1000 + index
        return SampledToken(request_id, 1000 + index, index, reason)
