"""Wire messages between the actors (and the durable request log).

Every message is a frozen msgspec Struct with a tag (so unions decode to the
right type) and a ``version`` field. MessagePack on Redis, one encoder.

A plan is one iteration of one worker (Orca's iteration-level scheduling):
the scheduler names, for every scheduled request, the prompt chunk it runs
this step or that it decodes one token. The scheduler owns the block tables
of every worker's paged K/V cache: a plan grants each request the physical
blocks it needs (``StepPlan.block_grants``), shared cached blocks of a prompt
prefix included, so the scheduler knows exactly what fits and what is cached;
the worker only writes and reads the blocks it is told to.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

WIRE_VERSION = 1

FinishReason = Literal["stop", "length", "cancelled"]
# An operator's name for tenants that share their prefix cache (tenants file).
CacheGroupName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]

# The sampling values the service admits and what the sampler does with them
# (one place, cited by docs/architecture.md; gpu_worker/sampler.py applies them).
# A temperature below GREEDY_TEMPERATURE_EPSILON samples greedily: dividing
# logits by it would overflow to inf (the softmax then is NaN), and a
# distribution that sharp is the argmax anyway (vLLM uses the same 1e-5).
GREEDY_TEMPERATURE_EPSILON = 1e-5
MAX_TEMPERATURE = 100.0
# top_p lies in (0, 1]; the most likely token is always kept, however small top_p is.
# top_k lies in [0, MAX_TOP_K]; 0, or any value >= the vocabulary, is no filter.
MAX_TOP_K = 2**63 - 1
MAX_SEED = 2**63 - 1
# min_tokens lies in [0, max_tokens]: while a request has generated fewer, its stop
# token ids (EOS and end-of-turn included, unless ignore_eos) cannot be sampled
# (their logits are -inf), as in vLLM; the gateway holds stop strings back as long.


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick each next token of one request.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` turn those
    filters off. ``seed`` makes sampling repeatable; the token at generation
    index i depends only on (seed, i) and the logits, never on the batch.
    ``min_tokens`` holds back every stop token id for generation indices below it.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Defaulted so that params written before min_tokens existed still decode.
    min_tokens: int = 0


class RequestSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request as a worker first sees it (at admission, or again after a
    preemption or a lost worker, when it is recomputed).

    ``num_prompt_tokens`` counts every token the worker will prefill before it
    samples: on a recompute that is the original prompt plus the
    ``num_generated`` tokens already sent to the client, so the next sampled
    token has generation index ``num_generated`` and ``max_tokens`` still
    counts from the original prompt.

    ``num_cached_tokens``: the first tokens whose K/V is already in the blocks
    this plan grants the request (a cached prefix: whole blocks, fewer than
    ``num_prompt_tokens``); its first prompt chunk starts there.
    """

    request_id: str
    num_prompt_tokens: int
    sampling: SamplingParams
    num_generated: int = 0
    gateway_id: str = ""  # where the worker publishes this request's tokens
    num_cached_tokens: int = 0


class PrefillChunk(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Part (or all) of a request's prompt, written at ``start_position``.

    The worker samples a token after the chunk that reaches
    ``num_prompt_tokens``.
    """

    request_id: str
    token_ids: list[int]
    start_position: int


class StepPlan(msgspec.Struct, frozen=True, tag="step_plan", forbid_unknown_fields=True):
    """One iteration of one worker: a single forward pass over all new tokens.

    Order of effects on the worker: forget ``released_request_ids`` (and their
    block tables), register ``new_requests``, append ``block_grants`` (request
    id -> physical block ids) to the requests' block tables, then run every
    prefill chunk and one decode token for each of ``decode_request_ids`` (the
    worker feeds each its last sampled token) in one selective-batched step.
    A decode for a request the worker already finished (it may be planned
    before the result that finished it returned: overlap) is skipped. Every
    slot a step writes lies in a block granted before; the worker never picks
    or frees a block itself (a finished request's table is just forgotten).
    """

    worker_id: str
    epoch: int
    step_index: int
    new_requests: list[RequestSpec] = []
    prefill_chunks: list[PrefillChunk] = []
    decode_request_ids: list[str] = []
    released_request_ids: list[str] = []
    version: int = WIRE_VERSION
    # Wall clock (time.time()) when the scheduler sent it; 0.0 when not stamped.
    planned_at: float = 0.0
    block_grants: dict[str, list[int]] = {}

    @property
    def num_new_tokens(self) -> int:
        """Total tokens this step runs through the model (Orca's flattened T)."""
        return sum(len(chunk.token_ids) for chunk in self.prefill_chunks) + len(
            self.decode_request_ids
        )


class SampledToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A token sampled for one request; ``index`` is its position among the
    request's generated tokens (0 for the first), the client's ``seq``.
    ``finish_reason`` is set on the request's last token. The first token of
    each placement carries ``num_cached_tokens``, the prompt tokens of that
    placement whose K/V came from the prefix cache (the client's
    ``usage.prompt_tokens_details.cached_tokens`` is the first token's)."""

    request_id: str
    token_id: int
    index: int
    finish_reason: FinishReason | None = None
    num_cached_tokens: int | None = None


class RequestFailure(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request the worker ended with an error in one step (its input or its
    numbers, not the plan): the worker dropped it and freed its K/V.
    ``message`` is plain text meant for the client (no reprs, no addresses)."""

    request_id: str
    message: str


class StepTiming(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one step's wall time went on its worker (``time.time()`` stamps,
    comparable with the scheduler's on one machine; durations in seconds).

    ``planned_at`` is the plan's own stamp; ``received_at`` when the worker
    read it; ``started_at``/``ended_at`` bracket the engine thread's work on
    it (validation, layout, forward, sampling, token routing); ``forward_s``
    is the model's forward pass and sampling inside that.
    """

    planned_at: float
    received_at: float
    started_at: float
    ended_at: float
    forward_s: float


class StepOutput(msgspec.Struct, frozen=True, tag="step_output", forbid_unknown_fields=True):
    """What one executed plan produced: the sampled tokens (at most one per
    request), the requests that failed in it, and how long the forward pass took."""

    worker_id: str
    epoch: int
    step_index: int
    tokens: list[SampledToken] = []
    num_new_tokens: int = 0
    step_ms: float = 0.0
    version: int = WIRE_VERSION
    # Defaulted so that an output written before failures were reported still decodes.
    failed: list[RequestFailure] = []
    timing: StepTiming | None = None
    # How the step ran (gpu_worker/step_path.py: "eager", "graph[1]", ...); "" for
    # an output without a forward pass, or from a worker that does not say.
    path: str = ""
    # A worker group's step: how long each pipeline stage computed it (ms, stage by
    # stage); empty for one engine.
    stage_ms: list[float] = []

    @property
    def finished_request_ids(self) -> list[str]:
        """Requests whose last token is in this output."""
        return [token.request_id for token in self.tokens if token.finish_reason is not None]


class TenantLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the scheduler enforces for one tenant, as the gateway's tenant table says.

    ``weight`` divides the tenant's VTC charges (2 gets twice the service of
    1); ``max_queued`` caps its requests waiting for a worker (one more is
    refused with ``queue_full``); ``max_in_flight`` caps its requests on
    workers at once (the others wait). Each submit carries the latest values.
    """

    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    max_queued: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Tenants of one cache group share cached prompt prefixes; None: the
    # tenant's own group (no other tenant can hit, or time, its cache).
    cache_group: CacheGroupName | None = None


class SubmitRequest(msgspec.Struct, frozen=True, tag="submit", forbid_unknown_fields=True):
    """Gateway → scheduler (requests stream): a tokenized, validated request."""

    request_id: str
    gateway_id: str
    tenant: str
    prompt_ids: list[int]
    sampling: SamplingParams
    # Defaulted so that a submit written before limits existed still decodes.
    limits: TenantLimits = TenantLimits()
    version: int = WIRE_VERSION


class CancelRequest(msgspec.Struct, frozen=True, tag="cancel", forbid_unknown_fields=True):
    """Gateway → scheduler (control stream): stop a request.

    With ``gateway_id`` the cancel is conditional: it stands only while that
    gateway still serves the request (its client's socket closed and nobody
    resumed it, here or elsewhere); the scheduler then records the end in the
    request's log itself."""

    request_id: str
    gateway_id: str = ""
    version: int = WIRE_VERSION


class RequestAdopted(msgspec.Struct, frozen=True, tag="adopted", forbid_unknown_fields=True):
    """Gateway → scheduler (control stream): a client resumed on this gateway a
    request another (dead) gateway accepted; it is not an orphan."""

    request_id: str
    gateway_id: str
    version: int = WIRE_VERSION


class WorkerJoined(msgspec.Struct, frozen=True, tag="worker_joined", forbid_unknown_fields=True):
    """Worker → scheduler (control stream): a worker is ready with this K/V capacity."""

    worker_id: str
    num_blocks: int
    block_size: int
    max_inflight: int
    version: int = WIRE_VERSION
    # Pipeline stages of a worker group (1: one engine). Above 1, a request is in
    # at most one of the worker's outstanding plans: its next input is the last
    # stage's sample, so the running requests rotate through disjoint batches.
    pipeline_depth: int = 1


class WorkerLeft(msgspec.Struct, frozen=True, tag="worker_left", forbid_unknown_fields=True):
    """Worker → scheduler (control stream): a worker is shutting down."""

    worker_id: str
    version: int = WIRE_VERSION


class TokenBatch(msgspec.Struct, frozen=True, tag="token_batch", forbid_unknown_fields=True):
    """Worker → one gateway (pub/sub): that gateway's tokens of one step."""

    worker_id: str
    tokens: list[SampledToken]
    version: int = WIRE_VERSION


class RequestRejected(msgspec.Struct, frozen=True, tag="rejected", forbid_unknown_fields=True):
    """Scheduler → gateway (pub/sub): a request the scheduler could not take."""

    request_id: str
    code: str  # a client protocol error code, e.g. "prompt_too_long"
    message: str
    version: int = WIRE_VERSION


class RequestRecord(msgspec.Struct, frozen=True, tag="record", forbid_unknown_fields=True):
    """Gateway → the request's log (first entry): everything needed to serve the
    request's stream again on any gateway, and to recover it in a new scheduler."""

    submit: SubmitRequest
    client_id: str  # the `id` of the client's `generate`
    stop: list[str] = []
    # False for a request that came over HTTP: its response is the only place
    # its tokens may go, so no `resume` (here or on another gateway) takes it.
    resumable: bool = True
    version: int = WIRE_VERSION


class RequestEnded(msgspec.Struct, frozen=True, tag="ended", forbid_unknown_fields=True):
    """Gateway → the request's log: the gateway ended the request itself (a
    cancel, a closed socket, a stop string) after its first ``num_tokens`` tokens."""

    request_id: str
    num_tokens: int
    version: int = WIRE_VERSION


class RequestFailed(msgspec.Struct, frozen=True, tag="failed", forbid_unknown_fields=True):
    """Worker or scheduler → the request's log: the service ended the request
    with an error (the ``RequestRejected`` its gateway was sent says the same).
    No token follows it; a gateway replaying the log ends the stream with an
    ``error`` frame of ``code`` and ``message``."""

    request_id: str
    code: str
    message: str
    version: int = WIRE_VERSION


WorkerMessage = StepPlan | StepOutput
ControlMessage = SubmitRequest | CancelRequest | RequestAdopted | WorkerJoined | WorkerLeft
GatewayMessage = TokenBatch | RequestRejected
# A request's log: its record, then the tokens workers sent (TokenBatch), maybe an
# end (RequestEnded by a gateway, RequestFailed by a worker or the scheduler).
RequestLogEntry = RequestRecord | TokenBatch | RequestEnded | RequestFailed

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WorkerMessage)
_control_decoder = msgspec.msgpack.Decoder(ControlMessage)
_gateway_decoder = msgspec.msgpack.Decoder(GatewayMessage)
_log_decoder = msgspec.msgpack.Decoder(RequestLogEntry)


def encode(message: msgspec.Struct) -> bytes:
    """MessagePack bytes of any wire Struct (the one encoder of the project)."""
    return _encoder.encode(message)


def decode_worker_message(data: bytes) -> StepPlan | StepOutput:
    """Decode a plan or step output; raises ``msgspec.DecodeError`` /
    ``msgspec.ValidationError`` on anything else."""
    return _decoder.decode(data)


def decode_step_plan(data: bytes) -> StepPlan:
    """A StepPlan (from a worker's plan stream); anything else is refused."""
    message = decode_worker_message(data)
    if not isinstance(message, StepPlan):
        raise msgspec.ValidationError(f"expected a step_plan, got {type(message).__name__}")
    return message


def decode_step_output(data: bytes) -> StepOutput:
    """A StepOutput (from the results stream); anything else is refused."""
    message = decode_worker_message(data)
    if not isinstance(message, StepOutput):
        raise msgspec.ValidationError(f"expected a step_output, got {type(message).__name__}")
    return message


def decode_control_message(
    data: bytes,
) -> SubmitRequest | CancelRequest | RequestAdopted | WorkerJoined | WorkerLeft:
    """Decode a message of the requests or control stream."""
    return _control_decoder.decode(data)


def decode_gateway_message(data: bytes) -> TokenBatch | RequestRejected:
    """Decode a message published to a gateway's channel."""
    return _gateway_decoder.decode(data)


def decode_log_entry(data: bytes) -> RequestRecord | TokenBatch | RequestEnded | RequestFailed:
    """Decode one entry of a request's log."""
    return _log_decoder.decode(data)
