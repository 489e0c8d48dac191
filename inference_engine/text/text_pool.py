"""The threads text work runs on (tokenizing, rendering chats, detokenizing), below the engine's priority.

The tokenizer releases the GIL (codec.py), so a long text no longer stops the engine thread;
but it still takes a core, and on a small machine the engine thread then waits for CPU. These
threads run at nice TEXT_NICE (Linux: a thread's own priority), so the scheduler gives the
engine the CPU first and text work the rest; an idle engine leaves text work all of it.
Measured on 2 shared cores (scripts/reliability.py --quick --sections text_stall, worst gap of a
stream beside back-to-back 65,536-character Tokenize calls / its median alone): 15x with the GIL
held, 3.7-5.7x released at nice 10, 2.3-3.3x at nice 19 (the stream alone: 1.8-2.1x).
Texts of --text-process-chars characters or more are not tokenized on these threads but in
tokenizer processes (tokenizer_processes.py); the thread only waits for their answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import sys
import threading
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
TEXT_THREADS = 2  # text calls tokenized at once (more wait their turn)
TEXT_NICE = 19  # niceness of the text threads (CFS weight 15 against the engine thread's 1024)
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _lower_priority() -> None:
    if sys.platform == "linux":  # setpriority on a thread id changes that thread only (elsewhere: the process)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TEXT_NICE)
        except OSError as exc:  # pragma: no cover - a sandbox without the right: text runs at normal priority
            log.warning("text threads keep the normal priority (%s)", exc)


def text_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's text threads (made on first use)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(TEXT_THREADS, "text", initializer=_lower_priority)
        return _pool


async def run_text(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a text thread, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(text_pool(), functools.partial(fn, *args))
