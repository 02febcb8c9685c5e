"""The tokenizer pool: a few threads that render chat templates and tokenize
prompts, so a 100,000-character prompt never holds the event loop that serves
every other socket's tokens.

Jobs wait in ``gateway/tokenize_queue.py``'s fair queue, not in the thread
pool's own FIFO: the pool hands a thread to the next job the queue names only
when one is free, so a tenant that floods the tokenizer waits behind itself,
and a tenant over its share of the queue gets ``queue_full`` alone. All of
that runs on the event loop; the threads only tokenize. Long prompts (at
least ``LARGE_JOB_CHARS``) get all threads but one, so a short prompt waits
for at most other short ones, never for a 100,000-character one to finish.

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

from gateway.tokenize_queue import TokenizeQueue, TokenizeQueueLimits
from gateway.tokenizer import ChatTokenizer
from gateway.validation import ModelLimits, ValidatedRequest, tokenize_generate
from shared.protocol import Generate

# Added to the gateway's niceness for each tokenizer thread (Linux sets it per thread).
TOKENIZE_NICENESS = 10
# A prompt this long (characters) takes milliseconds to tokenize (SmolLM2's:
# about 7 ms per 10,000 on a 2-core Xeon): it may not take the last free thread.
LARGE_JOB_CHARS = 10_000


def lower_this_threads_priority(by: int = TOKENIZE_NICENESS) -> None:
    """Make the calling thread ``by`` nicer; where the OS cannot, leave it as it is."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or refused
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + by)


class TokenizerPool:
    """``num_threads`` threads running ``tokenize_generate`` for the jobs of
    a fair queue bounded by ``queue_limits``; ``close`` waits for them. Used
    from one event loop."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        limits: ModelLimits,
        num_threads: int,
        queue_limits: TokenizeQueueLimits | None = None,
    ) -> None:
        assert num_threads >= 1
        self._tokenizer = tokenizer
        self._limits = limits
        self._num_threads = num_threads
        self._max_large_running = max(1, num_threads - 1)
        self._executor = ThreadPoolExecutor(
            max_workers=num_threads,
            thread_name_prefix="gateway-tokenize",
            initializer=lower_this_threads_priority,
        )
        # A job is the future its waiter awaits: resolved when it gets a thread.
        self.queue: TokenizeQueue[asyncio.Future[None]] = TokenizeQueue(
            queue_limits or TokenizeQueueLimits()
        )
        # The jobs on a thread (or handed one), each with whether it is large.
        self._running: dict[asyncio.Future[None], bool] = {}

    async def tokenize(
        self,
        generate: Generate,
        tenant: str,
        num_chars: int,
        weight: float = 1.0,
        max_tokens_cap: int | None = None,
    ) -> ValidatedRequest:
        """The tokenized request, computed on a pool thread once the queue
        gives this job one; raises TokenizerQueueFull at once when ``tenant``'s
        share (or the whole queue) is full, and RequestValidationError like
        ``tokenize_generate``. ``num_chars``: the prompt's characters (its cost)."""
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self.queue.push(turn, tenant, num_chars, weight)
        self._start_waiting()
        try:
            await turn
        except asyncio.CancelledError:
            # Given up while waiting (its HTTP client left, say), or just after
            # it was handed a thread: either way that place is free again.
            self._release(turn)
            raise
        try:
            work = self._executor.submit(
                tokenize_generate, generate, self._tokenizer, self._limits, max_tokens_cap
            )
        except RuntimeError:  # closed
            self._release(turn)
            raise
        # The thread is free when the work ends, even if nobody awaits it any more.
        work.add_done_callback(lambda _: self._release_from_thread(loop, turn))
        return await asyncio.wrap_future(work)

    def close(self) -> None:
        """Drop waiting jobs (their waiters get CancelledError) and wait for the
        running ones (their results go nowhere)."""
        while (queued := self.queue.pop()) is not None:
            self.queue.forget(queued.job)
            queued.job.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _start_waiting(self) -> None:
        """Hand free threads to the jobs the queue names next."""
        while len(self._running) < self._num_threads:
            num_large = sum(self._running.values())
            queued = self.queue.pop(
                None if num_large < self._max_large_running else LARGE_JOB_CHARS - 1
            )
            if queued is None:
                return
            turn = queued.job
            if turn.done():  # its waiter was cancelled and has yet to run
                self.queue.forget(turn)
                continue
            self._running[turn] = queued.num_chars >= LARGE_JOB_CHARS
            turn.set_result(None)

    def _release(self, turn: asyncio.Future[None]) -> None:
        self._running.pop(turn, None)
        self.queue.forget(turn)
        self._start_waiting()

    def _release_from_thread(
        self, loop: asyncio.AbstractEventLoop, turn: asyncio.Future[None]
    ) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(self._release, turn)
