"""The tokenizer pool's threads yield the CPU to everything else of the service."""

from __future__ import annotations

import os
import threading

from gateway.tokenizer_pool import TOKENIZE_NICENESS, TokenizerPool


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_tokenizer_threads_run_nicer_than_the_thread_that_made_the_pool() -> None:
    here = _niceness()
    pool = TokenizerPool(None, None, 2)  # type: ignore[arg-type]  # no tokenizing here
    try:
        there = {pool._executor.submit(_niceness).result() for _ in range(4)}
    finally:
        pool.close()
    assert there == {min(here + TOKENIZE_NICENESS, 19)}  # Linux caps niceness at 19
    assert _niceness() == here  # per thread: the event loop's is as it was
