"""The tokenizer pool: a few threads that render chat templates and tokenize
prompts, so a 100,000-character prompt never holds the event loop that serves
every other socket's tokens.

The pool's queue is bounded by the session, not here: at most
``max_tokenizing`` requests are pending at once (``gateway/admission.py``);
past that a ``generate`` is refused with ``queue_full`` before it is queued.

The threads run at a lower priority (``TOKENIZE_NICENESS``): tokenizing is the
gateway's only CPU-heavy work and any client may ask for the most of it, so
it takes the CPU that the engine and the event loops leave. On two cores at
the same priority, two clients sending 100,000-character prompts in a loop
made another client's stream five times slower (tests/adversarial/
test_event_loop.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits, ValidatedRequest, tokenize_generate
from shared.protocol import Generate

# Added to the gateway's niceness for each tokenizer thread (Linux sets it per thread).
TOKENIZE_NICENESS = 10


def lower_this_threads_priority(by: int = TOKENIZE_NICENESS) -> None:
    """Make the calling thread ``by`` nicer; where the OS cannot, leave it as it is."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or refused
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + by)


class TokenizerPool:
    """``num_threads`` threads running ``tokenize_generate``; ``close`` waits for them."""

    def __init__(self, tokenizer: ChatTokenizer, limits: ModelLimits, num_threads: int) -> None:
        self._tokenizer = tokenizer
        self._limits = limits
        self._executor = ThreadPoolExecutor(
            max_workers=num_threads,
            thread_name_prefix="gateway-tokenize",
            initializer=lower_this_threads_priority,
        )

    async def tokenize(
        self, generate: Generate, max_tokens_cap: int | None = None
    ) -> ValidatedRequest:
        """The tokenized request, computed on a pool thread; raises
        RequestValidationError like ``tokenize_generate``."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor,
            tokenize_generate,
            generate,
            self._tokenizer,
            self._limits,
            max_tokens_cap,
        )

    def close(self) -> None:
        """Drop queued jobs and wait for the running ones (their results go nowhere)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
