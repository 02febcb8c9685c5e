"""Pick each request's next token from its logits: greedy, temperature, top-k, top-p.

Randomness is per request and per token: the token at generation index i
draws from a generator seeded by ``mix(seed, i)``. A request's tokens thus do
not depend on which other requests share its batch, and a request recomputed
after a preemption or a lost worker draws exactly what it would have.
"""

from __future__ import annotations

import torch

from shared.messages import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """A well-spread 63-bit generator seed for token ``index`` of a request (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of ``logits`` [vocab] after temperature, top-k and top-p."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token once the mass before it already reaches top_p (the top one always stays).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.softmax(-1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]
) -> list[int]:
    """One token per row of ``logits`` [N, vocab] (fp32)."""
    token_ids = logits.argmax(dim=-1).tolist()  # greedy rows are done in one op
    for row, (row_params, seed, index) in enumerate(zip(params, seeds, indices, strict=True)):
        if row_params.temperature <= 0:
            continue
        probabilities = filtered_probabilities(logits[row], row_params)
        generator = torch.Generator(device=logits.device).manual_seed(mix_seed(seed, index))
        token_ids[row] = int(torch.multinomial(probabilities, 1, generator=generator))
    return token_ids
