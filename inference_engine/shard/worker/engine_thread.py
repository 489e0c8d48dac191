"""The one thread that runs a worker's engine calls, so MLX stays off the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from inference_engine.shard.protocol.errors import ShardUnavailable

T = TypeVar("T")


class EngineThread:
    """Runs a worker's engine calls one at a time on a dedicated thread, for asyncio callers."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-engine")
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the thread and return its result.

        If the awaiting task is cancelled, the call still completes before the
        cancellation propagates, so state it mutates is never left half-updated.

        Raises:
            ShardUnavailable once the thread has been closed (the worker is shutting down).
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
            ShardUnavailable once the thread has been closed (the worker is shutting down).
        """
        if self._closed:
            raise ShardUnavailable("the shard worker is shutting down")
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Refuse new calls and wait for the running one."""
        self._closed = True
        self._pool.shutdown(wait=True)
