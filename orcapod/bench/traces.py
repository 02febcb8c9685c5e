"""Request traces for ``orcapod bench``: seeded, repeatable, open loop.

Every trace is a list of ``TraceRequest`` with its arrival time, fixed before
the run starts, so arrivals never depend on how fast the service answers.

- ``orca``: Orca §6: Poisson arrivals, prompt ~ U(32, 512) tokens,
  max_tokens ~ U(1, 128), EOS ignored (exactly max_tokens are generated).
- ``homogeneous``: the paper's homogeneous traces: every request has the same
  prompt length and max_tokens (``--prompt-len``, ``--max-tokens``).
- ``chat``: real chat prompts through the chat template, EOS honoured.
- ``short``: short chats only (32-token prompt, 64 tokens out): the unloaded
  baseline of the mixed trace.
- ``mixed``: the short chats plus long prompts (U(384, 512) tokens, 8 out),
  one of each on average per arrival pair; the short chats' inter-token
  latency shows whether chunked prefill shields decodes from long prefills.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from shared.protocol import ChatMessage, Generate

TRACES = ("orca", "homogeneous", "chat", "short", "mixed")
# Token ids drawn for synthetic prompts: inside every Llama-family vocabulary
# (SmolLM2 has 49,152) and clear of the special tokens at the low end.
PROMPT_ID_RANGE = (1_000, 30_000)
SHORT_PROMPT_LEN, SHORT_MAX_TOKENS = 32, 64
LONG_PROMPT_RANGE, LONG_MAX_TOKENS = (384, 512), 8

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do airplanes stay in the air?",
    "Suggest a name for a friendly robot.",
    "What are the health benefits of walking every day?",
    "Write a short poem about autumn leaves.",
    "Why is the sky blue?",
    "How do I make a cup of green tea?",
    "What is a prime number? Give two examples.",
    "Describe a cat to someone who has never seen one.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a neural network is in simple words.",
)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace and when it arrives (seconds after the run starts)."""

    index: int
    arrival_s: float
    max_tokens: int
    ignore_eos: bool
    kind: str
    prompt_token_ids: tuple[int, ...] = ()
    chat_prompt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length when it is given as token ids (0 for a chat prompt)."""
        return len(self.prompt_token_ids)

    def generate_message(self, client_id: str, seed: int) -> Generate:
        """The ``generate`` frame that starts this request."""
        if self.chat_prompt is not None:
            return Generate(
                id=client_id,
                messages=[ChatMessage(role="user", content=self.chat_prompt)],
                max_tokens=self.max_tokens,
                temperature=0.7,
                seed=seed,
                ignore_eos=self.ignore_eos,
            )
        return Generate(
            id=client_id,
            prompt_token_ids=list(self.prompt_token_ids),
            max_tokens=self.max_tokens,
            temperature=0.0,
            ignore_eos=self.ignore_eos,
        )


@dataclass(frozen=True)
class TraceSpec:
    """What to generate; a run stops at ``num_requests`` or ``duration_s``, whichever first."""

    name: str
    rate_rps: float
    seed: int = 0
    num_requests: int | None = None
    duration_s: float | None = None
    prompt_len: int = 256  # homogeneous only
    max_tokens: int = 64  # homogeneous and chat

    def __post_init__(self) -> None:
        if self.name not in TRACES:
            raise ValueError(f"unknown trace {self.name!r}; choose from {', '.join(TRACES)}")
        if self.rate_rps <= 0:
            raise ValueError("the arrival rate must be positive")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("bound the trace with num_requests or duration_s")


def poisson_arrivals(
    rng: random.Random, rate_rps: float, num_requests: int | None, duration_s: float | None
) -> list[float]:
    """Arrival times of a Poisson process, until either bound is reached."""
    arrivals: list[float] = []
    now = 0.0
    while num_requests is None or len(arrivals) < num_requests:
        now += rng.expovariate(rate_rps)
        if duration_s is not None and now > duration_s:
            break
        arrivals.append(now)
    return arrivals


def _random_ids(rng: random.Random, length: int) -> tuple[int, ...]:
    low, high = PROMPT_ID_RANGE
    return tuple(rng.randrange(low, high) for _ in range(length))


def make_trace(spec: TraceSpec) -> list[TraceRequest]:
    """The requests of ``spec``: the same spec always gives the same trace."""
    rng = random.Random(f"{spec.name}:{spec.seed}:{spec.rate_rps}")
    arrivals = poisson_arrivals(rng, spec.rate_rps, spec.num_requests, spec.duration_s)
    trace = []
    for index, arrival_s in enumerate(arrivals):
        kind = spec.name
        if spec.name == "mixed":
            kind = rng.choice(("short", "long"))
        if kind == "orca":
            request = TraceRequest(
                index,
                arrival_s,
                max_tokens=rng.randint(1, 128),
                ignore_eos=True,
                kind=kind,
                prompt_token_ids=_random_ids(rng, rng.randint(32, 512)),
            )
        elif kind == "homogeneous":
            request = TraceRequest(
                index,
                arrival_s,
                spec.max_tokens,
                True,
                kind,
                prompt_token_ids=_random_ids(rng, spec.prompt_len),
            )
        elif kind == "short":
            ids = _random_ids(rng, SHORT_PROMPT_LEN)
            request = TraceRequest(index, arrival_s, SHORT_MAX_TOKENS, True, kind, ids)
        elif kind == "long":
            ids = _random_ids(rng, rng.randint(*LONG_PROMPT_RANGE))
            request = TraceRequest(index, arrival_s, LONG_MAX_TOKENS, True, kind, ids)
        else:  # chat: real prompts, the model decides when to stop
            prompt = CHAT_PROMPTS[rng.randrange(len(CHAT_PROMPTS))]
            request = TraceRequest(
                index, arrival_s, spec.max_tokens, False, kind, chat_prompt=prompt
            )
        trace.append(request)
    return trace
