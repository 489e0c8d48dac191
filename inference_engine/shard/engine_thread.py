"""The one thread that runs a worker's engine calls, so MLX stays off the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from inference_engine.shard.errors import ShardUnavailable

T = TypeVar("T")


class EngineThread:
    """Runs callables one at a time on a dedicated thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-engine")
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the engine thread.

        If the awaiting task is cancelled, the call still completes before the
        cancellation propagates, so engine state is never left half-updated.

        Raises:
            ShardUnavailable: the thread has been closed.
        """
        if self._closed:
            raise ShardUnavailable("the shard worker is shutting down")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    def close(self) -> None:
        """Refuse new calls and wait for the running one."""
        self._closed = True
        self._pool.shutdown(wait=True)
