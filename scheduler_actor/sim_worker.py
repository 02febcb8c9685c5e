"""A simulated GPU worker: executes StepPlans on counters instead of a model.

It follows the worker's side of shared/messages.py exactly (releases, then
registrations, then chunks and decodes; a token is sampled after the chunk
that completes the prompt and after each decode; a decode of a finished
request is skipped; a finished request's blocks are freed), counts its own
K/V blocks, and raises SimulatedWorkerError on any plan that breaks the
protocol or overflows its cache. The simulator and the property tests use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler_actor.block_ledger import num_blocks_for
from scheduler_actor.cost_model import CostModel
from shared.messages import FinishReason, SampledToken, StepOutput, StepPlan


class SimulatedWorkerError(AssertionError):
    """A plan broke the worker protocol or the worker's K/V budget."""


@dataclass(slots=True)
class _Sequence:
    num_prompt_tokens: int
    num_generated: int
    max_tokens: int
    num_kv_tokens: int = 0
    context_ids: list[int] = field(default_factory=list)


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
    ) -> None:
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._cost_model = cost_model
        self._stop_indices = stop_indices or {}
        self._sequences: dict[str, _Sequence] = {}
        self.num_steps = 0

    @property
    def num_used_blocks(self) -> int:
        """Blocks holding K/V of live sequences."""
        return sum(
            num_blocks_for(s.num_kv_tokens, self.block_size) for s in self._sequences.values()
        )

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
                spec.num_prompt_tokens, spec.num_generated, spec.sampling.max_tokens
            )
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
            sequence.num_kv_tokens += num
            sequence.context_ids += chunk.token_ids
            num_new_tokens += num
            if sequence.num_kv_tokens == sequence.num_prompt_tokens:
                tokens.append(self._sample(chunk.request_id, sequence))
        for request_id in plan.decode_request_ids:
            sequence = self._sequences.get(request_id)
            if sequence is None:
                continue  # finished at an earlier step (overlap) or released
            if sequence.num_kv_tokens < sequence.num_prompt_tokens:
                raise SimulatedWorkerError(f"decode of {request_id} before its prompt ran")
            sequence.num_kv_tokens += 1
            num_attended += sequence.num_kv_tokens
            num_new_tokens += 1
            tokens.append(self._sample(request_id, sequence))
        if self.num_used_blocks > self.num_blocks:
            raise SimulatedWorkerError(f"{self.worker_id} overflowed its {self.num_blocks} blocks")
        # The worker frees a finished request's blocks at the end of the step.
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
        )
        return output, step_s

    def _sample(self, request_id: str, sequence: _Sequence) -> SampledToken:
        index = sequence.num_generated
        sequence.num_generated += 1
        reason: FinishReason | None = None
        if index + 1 >= sequence.max_tokens:
            reason = "length"
        elif self._stop_indices.get(request_id) == index:
            reason = "stop"
        # A token id derived from the position, so a recompute can be checked.
        return SampledToken(request_id, 1000 + index, index, reason)
