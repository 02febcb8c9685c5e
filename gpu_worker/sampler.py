"""Pick each request's next token from its logits: greedy, temperature, top-k, top-p.

Randomness is per request and per token: the token at generation index i
draws from a generator seeded by ``mix(seed, i)``. A request's tokens thus do
not depend on which other requests share its batch, and a request recomputed
after a preemption or a lost worker draws exactly what it would have.

Every value the protocol admits is defined here (the limits are in
``shared/messages.py``): a temperature below ``GREEDY_TEMPERATURE_EPSILON``
is greedy, the filters run in float64 (logits up to fp32's largest divided by
the smallest sampled temperature stay finite, and a top_p far below fp32's
smallest still compares as itself), the top token always survives top_p, and
top_k at or past the vocabulary is no filter. A row whose generation index
is below its ``min_tokens`` has its request's stop token ids masked to -inf
first (vLLM's ``min_tokens``): the mask depends only on the request and the
index, so the rule above still holds. What cannot be sampled — a row with a
NaN or +inf, or with every logit -inf (after that mask) — is that row's
``SamplingError``; the other rows get their tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec
import torch

from shared.messages import GREEDY_TEMPERATURE_EPSILON, SamplingParams

_MASK64 = (1 << 64) - 1


class SamplingError(ValueError):
    """A row's logits hold nothing to sample from (a numeric blow-up upstream)."""


def mix_seed(seed: int, index: int) -> int:
    """A well-spread 63-bit generator seed for token ``index`` of a request (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def is_greedy(params: SamplingParams) -> bool:
    """Whether the request takes the argmax (``not >=`` also catches a NaN)."""
    return not params.temperature >= GREEDY_TEMPERATURE_EPSILON


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax (float64) of ``logits`` [vocab] after temperature, top-k and top-p.

    ``logits`` must have a finite maximum and no NaN (``sample`` checks);
    the result then sums to 1 with the top token's probability > 0.
    """
    scaled = logits.double() / max(params.temperature, GREEDY_TEMPERATURE_EPSILON)
    if 0 < params.top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token once the mass before it already reaches top_p.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        # The top token stays whatever top_p is (rounding must not empty the set).
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.softmax(-1)


def mask_stop_token_ids(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    indices: Sequence[int],
    stop_token_ids: Sequence[Collection[int]],
) -> torch.Tensor:
    """``logits`` [N, vocab] with each row's ``stop_token_ids`` at -inf while its
    generation index is below its ``min_tokens`` (a new tensor; the same one when
    no row is held back). Ids outside the vocabulary can never be sampled: skipped."""
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    columns: list[int] = []
    for row, (row_params, index, row_stop_ids) in enumerate(
        zip(params, indices, stop_token_ids, strict=True)
    ):
        if index < row_params.min_tokens:
            for token_id in row_stop_ids:
                if 0 <= token_id < vocab_size:
                    rows.append(row)
                    columns.append(token_id)
    if not rows:
        return logits
    positions = torch.tensor([rows, columns], dtype=torch.int64, device=logits.device)
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((positions[0], positions[1]), minus_inf)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    indices: list[int],
    stop_token_ids: Sequence[Collection[int]] | None = None,
) -> list[int | SamplingError]:
    """One token per row of ``logits`` [N, vocab], or that row's SamplingError.

    ``stop_token_ids[row]`` are the ids that would end the row's request (its
    own, and EOS unless it ignores it); they cannot be drawn before its
    ``min_tokens``. None: no row has any.
    """
    if stop_token_ids is not None:
        logits = mask_stop_token_ids(logits, params, indices, stop_token_ids)
    # One pass over the batch for the argmax and the rows that cannot be sampled:
    # a row's max is NaN where it holds one (max propagates it), +inf where it
    # holds that, -inf where all are, and finite only where the row is usable.
    largest, argmax = logits.max(dim=-1)  # [N]; the first of equal maxima, as argmax
    usable = largest.isfinite().tolist()
    token_ids: list[int | SamplingError] = list(argmax.tolist())
    for row, (row_params, seed, index) in enumerate(zip(params, seeds, indices, strict=True)):
        if not usable[row]:
            token_ids[row] = SamplingError("the model's output for this request was not finite")
            continue
        if is_greedy(row_params):
            continue
        probabilities = filtered_probabilities(logits[row], row_params)
        generator = torch.Generator(device=logits.device).manual_seed(mix_seed(seed, index))
        token_ids[row] = int(torch.multinomial(probabilities, 1, generator=generator))
    return token_ids


class SamplingRow(msgspec.Struct, frozen=True, array_like=True):
    """What the sampler needs of one row: its request's parameters and seed, its
    generation index, and the ids that would end it (a Struct: a pipeline's first
    stage sends the rows to the last one, which samples)."""

    params: SamplingParams
    seed: int
    index: int
    stop_token_ids: list[int]


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int | str]:
    """``sample`` over ``rows``: each row's token id, or why it could not be sampled."""
    sampled = sample(
        logits,
        [row.params for row in rows],
        [row.seed for row in rows],
        [row.index for row in rows],
        # Held back (masked) while a request is short of its min_tokens.
        [row.stop_token_ids for row in rows],
    )
    return [str(outcome) if isinstance(outcome, SamplingError) else outcome for outcome in sampled]
