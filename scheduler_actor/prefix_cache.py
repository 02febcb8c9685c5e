"""Automatic prefix caching: a request's cached prefix on a worker, and caching what it computed.

A full block of a request's tokens is named by a chain hash: BLAKE2b-128 of
the previous block's hash and this block's token ids, starting from a seed
made of the request's cache group. Equal hashes mean equal tokens from
position 0 in the same group, so equal K/V on one worker (each worker's
ledger is its own: one model, one weight format; a worker that joins again
starts empty). Tenants are in a group of their own unless the operator puts
them in a shared one, so no tenant can hit, or time, another's blocks.

A block is cached (``commit_confirmed``) only once the step that wrote it
has returned: what is cached is known to be written, whatever fails later.
That is checked twice per placement: when its first token comes back (the
whole context is written: a shared system prompt is found by the requests
admitted after) and when it leaves its worker (finished, cancelled,
preempted: its answer too, for a conversation's next turn). A hit stops one
token short of the context, so a placement always computes the token it
samples from.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b
from itertools import islice

from scheduler_actor.block_ledger import BlockLedger
from scheduler_actor.request import Request

HASH_BYTES = 16
_SEED_DOMAIN = b"orcapod/kv-prefix/1\0"


def cache_group_of(tenant: str, cache_group: str | None) -> str:
    """The cache a tenant's requests share: its operator-given group, else its own."""
    return f"group:{cache_group}" if cache_group else f"tenant:{tenant}"


def block_hashes(request: Request, block_size: int, num_blocks: int) -> list[bytes]:
    """The request's chain, long enough for its first ``num_blocks`` full
    blocks (prompt, then generated): item ``i + 1`` is block ``i``'s hash, item
    0 the seed. Computed once per request and block size, and kept; not a copy."""
    hashes = request.block_hashes.get(block_size)
    if hashes is None:
        seed = blake2b(_SEED_DOMAIN + request.cache_group.encode(), digest_size=HASH_BYTES)
        hashes = request.block_hashes[block_size] = [seed.digest()]
    if len(hashes) <= num_blocks:
        prompt, generated = request.prompt_ids, request.generated_ids
        num_prompt = len(prompt)
        previous = hashes[-1]
        for index in range(len(hashes) - 1, num_blocks):
            start, end = index * block_size, (index + 1) * block_size
            if end <= num_prompt:
                tokens = prompt[start:end]
            else:
                tokens = prompt[start:] + generated[max(0, start - num_prompt) : end - num_prompt]
            previous = blake2b(
                previous + array("q", tokens).tobytes(), digest_size=HASH_BYTES
            ).digest()
            hashes.append(previous)
    return hashes


def prefix_hit(ledger: BlockLedger, request: Request) -> list[int]:
    """The worker's blocks that cache the longest prefix of the request's
    context (prompt plus what it generated), leaving at least one token to compute."""
    if not ledger.prefix_caching:
        return []
    num_context_tokens = len(request.prompt_ids) + len(request.generated_ids)
    block_size = ledger.block_size
    num_blocks = (num_context_tokens - 1) // block_size
    # Most prompts miss at their first block: hash the rest only after a hit there.
    if not num_blocks or not ledger.match(block_hashes(request, block_size, 1)[1:2]):
        return []
    return ledger.match(islice(block_hashes(request, block_size, num_blocks), 1, num_blocks + 1))


def commit_confirmed(ledger: BlockLedger, request: Request) -> None:
    """Cache the full blocks a placed request's returned steps wrote: once a
    step of this placement sampled a token, every position before the newest
    token's holds K/V (the newest one is fed by the next step)."""
    num_generated_before = len(request.context_ids) - len(request.prompt_ids)
    if ledger.prefix_caching and len(request.generated_ids) > num_generated_before:
        num_written = len(request.prompt_ids) + len(request.generated_ids) - 1
        _commit_written(ledger, request, num_written)


def _commit_written(ledger: BlockLedger, request: Request, num_written_tokens: int) -> None:
    """The request's first ``num_written_tokens`` positions hold K/V on its
    worker: cache its full blocks among them."""
    num_full = min(num_written_tokens // ledger.block_size, len(request.block_ids))
    first = request.num_committed_blocks
    if num_full <= first:
        return
    hashes = block_hashes(request, ledger.block_size, num_full)
    block_ids, group = request.block_ids, request.cache_group
    for index in range(first, num_full):
        ledger.commit(block_ids[index], hashes[index + 1], group)
    request.num_committed_blocks = num_full
