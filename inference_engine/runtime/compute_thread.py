"""The one thread that runs model compute, so MLX stays off the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class ComputeThread:
    """Runs callables one at a time on a dedicated thread, for asyncio callers."""

    def __init__(self, name: str, unavailable: Callable[[], Exception]):
        """
        Args:
            name: thread name prefix (shows in stack dumps).
            unavailable: builds the error raised by `run` after `close`.
        """
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._unavailable = unavailable
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the thread and return its result.

        If the awaiting task is cancelled, the call still completes before the
        cancellation propagates, so state it mutates is never left half-updated.

        Raises:
            The `unavailable()` error once the thread has been closed.
        """
        fut = self.submit(fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    def submit(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """Queue `fn(*args)` on the thread now; its future resolves on the running loop.

        The work starts without waiting for the caller to yield (no task in between), so a
        caller that awaits the future later overlaps its own work with the computation.
        The caller must not cancel the future (the call completes anyway); await it or
        `asyncio.wait` it.

        Raises:
            The `unavailable()` error once the thread has been closed.
        """
        if self._closed:
            raise self._unavailable()
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Refuse new calls and wait for the running one."""
        self._closed = True
        self._pool.shutdown(wait=True)
