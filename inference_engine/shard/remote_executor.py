"""RemoteExecutor: a verifier's layers on a route of shard workers, called from the engine thread.

The engine thread is synchronous; the `ShardPipeline` lives on the server's event loop.
`ShardRoute.call` bridges the two with `asyncio.run_coroutine_threadsafe(...).result()`
(the loop is free while the engine thread waits).

Recovery: the executor keeps the tokens at positions 0..offset. When a route call fails
(a worker died, a stream broke), it waits for the route to answer again, opens the
session at a newer route epoch, replays those tokens (exact: chunking does not change
the bits) and retries the call once, so the caller sees a delay, never a wrong token.
If the route stays silent past `recovery_timeout_s` the call fails with
`ShardUnavailable` (UNAVAILABLE) and the next call tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from typing import Awaitable, Callable, TypeVar

import mlx.core as mx

from inference_engine.errors import InvalidRequest, PoolExhausted, RuntimeServiceError
from inference_engine.shard.errors import ShardUnavailable
from inference_engine.shard.pipeline import ShardPipeline
from inference_engine.verifier.executor import Executor
from inference_engine.verifier.kv_cache import CacheGeometry

T = TypeVar("T")
log = logging.getLogger(__name__)
REPLAY_CHUNK = 1024  # tokens per replay frame (keeps activation messages small)


class ShardRoute:
    """A connected ShardPipeline, the event loop that owns it and the recovery policy."""

    def __init__(self, pipeline: ShardPipeline, loop: asyncio.AbstractEventLoop, recovery_timeout_s: float = 60.0,
                 retry_interval_s: float = 0.25):
        """
        Args:
            pipeline: connected (`capabilities` known).
            loop: the running loop the pipeline's channels belong to (not the caller's thread).
            recovery_timeout_s: how long a call waits for a silent route before UNAVAILABLE.
            retry_interval_s: pause between reconnection attempts.
        """
        self.pipeline = pipeline
        self.loop = loop
        self.recovery_timeout_s = recovery_timeout_s
        self.retry_interval_s = retry_interval_s
        self.is_closed = False  # set at shutdown: recovery stops waiting

    def close(self) -> None:
        """Stop waiting for the route: restores in progress fail UNAVAILABLE at once."""
        self.is_closed = True

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run `make()` on the pipeline's loop and wait for it (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(_awaited(make), self.loop).result()

    def release_later(self, session_id: str) -> None:
        """Free a session on the workers without waiting (safe from any thread, even the loop's)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(_quiet_release(self.pipeline, session_id)))


async def _awaited(make: Callable[[], Awaitable[T]]) -> T:
    return await make()


async def _quiet_release(pipeline: ShardPipeline, session_id: str) -> None:
    try:
        await pipeline.release(session_id)
    except Exception as exc:  # the worker may be gone: its sessions went with it
        log.debug("release of %s on the route failed: %s", session_id, exc)


class RemoteExecutor(Executor):
    """One session's K/V on every worker of a route; exact replay after any route failure."""

    def __init__(self, route: ShardRoute, geometry: CacheGeometry, nbytes: int):
        """Open the session on the route (waiting up to `recovery_timeout_s` for it).

        Args:
            route: the route and its loop.
            geometry: the single-process geometry (same max_block, so the same bits and ring).
            nbytes: K/V bytes the session holds across the workers (as one process would).
        Raises:
            ShardUnavailable: the route did not answer in time.
            InvalidRequest, PoolExhausted: the workers refused the geometry or have no room.
        """
        self.route = route
        self.geometry = geometry
        self._nbytes = nbytes
        self.session_id = f"rx-{uuid.uuid4().hex}"  # a fresh route session per executor (rebuilds too)
        self._tokens: list[int] = []  # tokens at positions 0..offset (the replay log)
        self._epoch = 0  # route epoch the session is open at (0: not open)
        self._needs_replay = True  # the workers' K/V does not match `_tokens`
        self._restore()
        weakref.finalize(self, route.release_later, self.session_id)

    @property
    def offset(self) -> int:
        return len(self._tokens)

    def forward(self, tokens: list[int], all_logits: bool, wait: bool = True) -> mx.array:
        p = self.route.pipeline  # the route answers with computed logits: `wait` changes nothing
        logits = self._call(lambda: p.forward(self.session_id, tokens, all_logits=all_logits))
        self._tokens += tokens
        return mx.array(logits)

    def trim(self, n: int) -> None:
        if n == 0:
            return
        # Recorded first: if the workers cannot trim now, the next call replays the trimmed log.
        del self._tokens[len(self._tokens) - n :]
        if self._needs_replay:
            return
        try:
            p = self.route.pipeline
            self.route.call(lambda: p.trim(self.session_id, n))
        except RuntimeServiceError as exc:
            log.warning("route session %s: trim failed (%s); it will be replayed", self.session_id, exc)
            self._needs_replay = True

    def layer_digests(self) -> list[bytes]:
        p = self.route.pipeline
        return self._call(lambda: p.layer_digests(self.session_id))

    @property
    def nbytes(self) -> int:
        return self._nbytes

    # -- recovery --------------------------------------------------------------------

    def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        """A route call on a usable session; after a failure, restore once and retry."""
        if self._needs_replay:
            self._restore()
        try:
            return self.route.call(make)
        except InvalidRequest:
            raise  # refused before sending (bad tokens): the session is intact
        except RuntimeServiceError as exc:
            self._needs_replay = True
            log.warning("route session %s failed (%s: %s); restoring it", self.session_id, type(exc).__name__, exc)
        self._restore()
        try:
            return self.route.call(make)
        except RuntimeServiceError:
            self._needs_replay = True
            raise

    def _restore(self) -> None:
        """Open the session at a newer epoch and replay `_tokens` (waits for the route)."""
        self.route.call(self._reopen)
        self._needs_replay = False

    async def _reopen(self) -> None:
        r, p = self.route, self.route.pipeline
        g = self.geometry
        deadline = time.monotonic() + r.recovery_timeout_s
        while True:
            try:
                if self._epoch:  # supersede the broken incarnation on every worker
                    if p.epoch <= self._epoch:
                        p.advance_epoch()
                    await p.connect()  # re-check the route (a restarted worker must run the same layers)
                await p.open(self.session_id, g.sink, g.window, max_block=g.max_block, max_rollback=g.max_rollback)
                self._epoch = p.epoch
                for i in range(0, len(self._tokens), REPLAY_CHUNK):
                    await p.forward(self.session_id, self._tokens[i : i + REPLAY_CHUNK], all_logits=False)
                if self._tokens:
                    log.info("route session %s restored at epoch %d (%d tokens replayed)", self.session_id,
                             self._epoch, len(self._tokens))
                return
            except (InvalidRequest, PoolExhausted):
                raise  # the workers refuse this session: waiting will not help
            except RuntimeServiceError as exc:
                if time.monotonic() >= deadline or r.is_closed:
                    raise ShardUnavailable(
                        f"the shard route {','.join(p.addresses)} is not answering ({type(exc).__name__}: {exc}); "
                        "the session is kept and is replayed when every worker is back: retry shortly"
                    ) from exc
                self._epoch = self._epoch or p.epoch  # a failed first open still needs a newer epoch
                await asyncio.sleep(r.retry_interval_s)
