"""ShardRoute: a ShardPipeline on an event loop of its own, callable from the engine thread.

The engine thread is synchronous and must never wait on the server's event loop (that loop
serves the RPCs the engine thread is computing for). So the route client runs on its own
loop in its own thread: the engine thread hands it a coroutine and waits for the answer
(`call`); the server's loop only ever `await`s it (`start`, `stop`). Calls for different
sessions run concurrently on the route's loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable, Callable, Sequence, TypeVar

from inference_engine.errors import InvalidRequest
from inference_engine.security.settings import ClientSecurity
from inference_engine.shard.client.pipeline import ShardPipeline

T = TypeVar("T")
log = logging.getLogger(__name__)


class ShardRoute:
    """A connected route of shard workers, its own loop thread and the recovery policy."""

    def __init__(self, addresses: Sequence[str], recovery_timeout_s: float = 60.0, retry_interval_s: float = 0.25,
                 step_timeout_s: float = 30.0, channel_security: ClientSecurity | None = None):
        """
        Args:
            addresses: "host:port" of each worker, head first.
            recovery_timeout_s: how long a call waits for a silent route before UNAVAILABLE, counted from
                the request the route stopped answering.
            retry_interval_s: pause between reconnection attempts.
            step_timeout_s: deadline of one work frame on one worker; a worker that misses it has failed
                (the session is replayed); at most `recovery_timeout_s` (a worker silent that long is a silent route).
            channel_security: CA, client certificate and token presented to the workers (None = plaintext).
        """
        self.pipeline = ShardPipeline(addresses, step_timeout_s=min(step_timeout_s, recovery_timeout_s),
                                      channel_security=channel_security)
        self.recovery_timeout_s = recovery_timeout_s
        self.retry_interval_s = retry_interval_s
        self.is_closed = False  # set at shutdown: recovery stops waiting
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shard-route", daemon=True)
        self._thread.start()

    async def start(self) -> None:
        """Connect to every worker (await from any loop).

        Raises:
            ShardUnavailable: a worker cannot be reached.
            InvalidRequest: the workers do not form one route of one model.
        """
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.pipeline.connect(), self._loop))

    def check_serves(self, fingerprint: str, kernels: str, block: int, rollback: int) -> None:
        """The route must run this model with these kernels, at this block and rollback room.

        Raises:
            InvalidRequest: what differs, and how to start the workers instead.
        """
        p = self.pipeline
        head = p.capabilities[0]
        if head.model_fingerprint != fingerprint:
            raise InvalidRequest(f"the shard route runs {head.model_name} ({head.num_layers} layers, fingerprint "
                                 f"{head.model_fingerprint[:12]}); this server loaded fingerprint {fingerprint[:12]}: "
                                 "both must run the same model")
        if head.kernels != kernels:
            raise InvalidRequest(f"the shard route computes with {head.kernels!r}, this server with {kernels!r}: start "
                                 "both the same way (same BLAS and kernel) to be bitwise exact")
        if p.max_block < block or p.max_rollback < rollback:
            raise InvalidRequest(f"the shard route accepts blocks of {p.max_block} and rollback {p.max_rollback}; this "
                                 f"server needs block {block} (its probed tile) and rollback {rollback}: start the "
                                 f"workers with --max-rollback >= {rollback} (and --block >= {block} or a probe that "
                                 "reaches it)")

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run `make()` on the route's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(_awaited(make), self._loop).result()

    def call_later(self, make: Callable[[], Awaitable[object]]) -> None:
        """Run `make()` on the route's loop without waiting; failures are logged (from any thread)."""
        if not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(_logged(make), self._loop)

    async def stop(self) -> None:
        """Stop waiting for silent workers, close the pipeline and the loop thread (await from any loop)."""
        self.is_closed = True
        if self._loop.is_closed():
            return
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_close(self.pipeline), self._loop))
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)
        self._loop.close()


async def _close(pipeline: ShardPipeline) -> None:
    """Close the pipeline, then end every task left on the route's loop (stream pumps, releases)."""
    await pipeline.close()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _awaited(make: Callable[[], Awaitable[T]]) -> T:
    return await make()


async def _logged(make: Callable[[], Awaitable[object]]) -> None:
    try:
        await make()
    except Exception as exc:  # noqa: BLE001 - fire and forget: a worker may be gone, its sessions with it
        log.debug("background route call failed: %s", exc)
