"""RouteBackend: the target's layers on a route of shard workers, one RemoteExecutor per session.

The blocks of a batch go through the route together: one Batch message per hop carries every
session's block (`ShardPipeline.forward_many`), and each worker computes them in one forward
(`runtime/batch_queue.py`); a lone block, or a session being restored, takes its own stream.
A route session is replayed from the session's token log when the route fails: when a call
fails (a worker died, a stream broke), the executor waits for the route to answer again, opens the session at a newer
route epoch, replays the log up to its position (exact: chunking does not change the
bits) and retries the call once, so the caller sees a delay, never a wrong token. A worker
that does not answer within the route's step deadline has failed too. If the route stays
silent for `recovery_timeout_s`, counted from the request it stopped answering, the call fails
with `ShardUnavailable` (UNAVAILABLE; every attempt is cut off at that time, so a hung worker
cannot hold it longer) and the next call tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Awaitable, Callable, Sequence, TypeVar

import mlx.core as mx
import numpy as np

from inference_engine.errors import InvalidRequest, InvariantViolation, PoolExhausted, RuntimeServiceError
from inference_engine.model.loader import ModelSpec
from inference_engine.shard.client.route import ShardRoute
from inference_engine.shard.protocol.errors import DeadlineExpired, ShardUnavailable
from inference_engine.execution.executor import Backend, Block, Executor
from inference_engine.execution.kv_cache import CacheGeometry, CanonicalKV
from inference_engine.execution.sliding_kv_cache import session_slab_bytes
from inference_engine.execution.token_log import TokenLog

T = TypeVar("T")
log = logging.getLogger(__name__)
REPLAY_CHUNK = 1024  # tokens per replay frame (keeps activation messages small)


class RouteBackend(Backend):
    """Sessions' K/V on every worker of a route; blocks forwarded through the route."""

    def __init__(self, route: ShardRoute, spec: ModelSpec, max_block: int):
        """
        Args:
            route: connected, and checked to serve this model at `max_block` (`check_serves`).
            spec: the model's shape facts (what a session's slab costs, as in one process).
            max_block: the server's probed tile: every worker chunks at it, so the bits are one process's.
        """
        self.route = route
        self.spec = spec
        self.max_block = max_block

    def open(self, geometry: CacheGeometry, log: TokenLog, prepared: object | None = None) -> Executor:
        return RemoteExecutor(self, geometry, log)  # the K/V lives on the workers: nothing prepared here

    def forward(self, blocks: Sequence[Block], wait: bool = True) -> list[mx.array | BaseException]:
        return [r if isinstance(r, BaseException) else mx.array(r) for r in self.route.call(lambda: self._all(blocks))]

    async def _all(self, blocks: Sequence[Block]) -> list[object]:
        """Each block's logits (or exception): the usable sessions' in one forward_many, then any
        failed or restoring one through its own executor (which restores it and retries once)."""
        executors: list[RemoteExecutor] = [b.executor for b in blocks]  # type: ignore[misc] - this backend's
        out: list[object] = [None] * len(blocks)
        together = [i for i, e in enumerate(executors) if not e.needs_replay]
        sent = time.monotonic()  # a session failed below has waited on the route since then
        if len(together) > 1:
            try:
                results: list[object] = await self.route.pipeline.forward_many(
                    [(executors[i].session_id, blocks[i].tokens, blocks[i].all_logits) for i in together])
            except RuntimeServiceError as exc:  # nothing was sent (the route is not connected): each alone
                results = [exc] * len(together)
            for i, r in zip(together, results):
                if not isinstance(r, BaseException):
                    executors[i].advanced(len(blocks[i].tokens))
                    out[i] = r
                elif isinstance(r, InvalidRequest):
                    out[i] = r  # refused before sending: the session is intact
        rest = [i for i in range(len(blocks)) if out[i] is None]
        alone = await asyncio.gather(*(executors[i].forward_async(blocks[i].tokens, blocks[i].all_logits,
                                                                  sent if i in together else None) for i in rest),
                                     return_exceptions=True)
        for i, r in zip(rest, alone):
            out[i] = r
        return out


class RemoteExecutor(Executor):
    """One session's K/V on every worker of a route; exact replay from the log after any route failure."""

    def __init__(self, backend: RouteBackend, geometry: CacheGeometry, log: TokenLog):
        """Open the session on the route (waiting up to `recovery_timeout_s` for it).

        Raises:
            ShardUnavailable: the route did not answer in time.
            InvalidRequest, PoolExhausted: the workers refused the geometry or have no room.
        """
        self.backend = backend
        self.route = backend.route
        self.geometry = geometry
        self.log = log  # the session's log: positions 0..offset are replayed from it
        self.session_id = f"rx-{uuid.uuid4().hex}"  # a fresh route session per executor (rebuilds too)
        self._offset = 0  # positions computed on the workers, including a pending block
        self._epoch = 0  # route epoch of the latest SessionOpen sent for the session (0: none yet)
        self._needs_replay = True  # the workers' K/V does not match the log up to `_offset`
        self._is_closed = False
        self.route.call(lambda: self._reopen(0, time.monotonic() + self.route.recovery_timeout_s))

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def needs_replay(self) -> bool:
        """The workers' K/V may not match the log: the next call restores the session first."""
        return self._needs_replay

    def advanced(self, rows: int) -> None:
        """A block of `rows` rows went through the route for this session (forward_many)."""
        self._offset += rows

    async def forward_async(self, tokens: tuple[int, ...], all_logits: bool, sent: float | None = None) -> np.ndarray:
        """The block through the route (on the route's loop), recovering once after a failure.

        Args:
            sent: when the block was first sent (monotonic), if a batched forward already failed it.
        """
        p, start = self.route.pipeline, self._offset
        logits = await self._recovering(lambda: p.forward(self.session_id, tokens, all_logits=all_logits), start, sent)
        self._offset = start + len(tokens)
        return logits

    def trim(self, n: int) -> None:
        if n == 0:
            return
        # Recorded first: if the workers cannot trim now, the next call replays the log.
        self._offset -= n
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
        return self.route.call(lambda: self._recovering(lambda: p.layer_digests(self.session_id), self._offset))

    def canonical_kv(self) -> CanonicalKV:
        p = self.route.pipeline
        layers = self.route.call(lambda: self._recovering(lambda: p.export_kv(self.session_id), self._offset))
        keys, values = zip(*layers)
        return CanonicalKV(self._offset, np.stack(keys), np.stack(values))  # (L, n_kv, n, D) each

    def load_canonical_kv(self, kv: CanonicalKV) -> None:
        if self._offset != 0:
            raise InvariantViolation(f"canonical K/V loads into a fresh executor (this one is at {self._offset})")
        s, p = self.backend.spec, self.route.pipeline
        n = len(self.geometry.visible_positions(kv.position)[:-1]) if kv.position else 0
        want = (s.num_layers, s.num_kv_heads, n, s.head_dim)
        if kv.keys.shape != want or kv.values.shape != want:
            raise InvariantViolation(f"canonical K/V of shape {list(kv.keys.shape)} does not fit this model at "
                                     f"position {kv.position}; expected {list(want)}")
        layers = list(zip(kv.keys, kv.values))
        # A route failure midway reopens the session empty (the log is replayed only up to 0) and retries once.
        self.route.call(lambda: self._recovering(lambda: p.import_kv(self.session_id, kv.position, layers), 0))
        self._offset = kv.position

    @property
    def nbytes(self) -> int:
        s = self.backend.spec
        return session_slab_bytes(self.geometry, s)

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        p, sid = self.route.pipeline, self.session_id
        self.route.call_later(lambda: p.release(sid))

    # -- recovery --------------------------------------------------------------------

    async def _recovering(self, make: Callable[[], Awaitable[T]], position: int, sent: float | None = None) -> T:
        """A route call on a usable session at `position`; after a failure, restore once and retry.

        Args:
            sent: when the call was first sent (monotonic), if it already failed once (default: now).
        """
        wait_s = self.route.recovery_timeout_s
        if self._needs_replay:
            await self._reopen(position, time.monotonic() + wait_s)
        sent = time.monotonic() if sent is None else sent
        try:
            return await make()
        except InvalidRequest:
            raise  # refused before sending (bad tokens): the session is intact
        except RuntimeServiceError as exc:
            self._needs_replay = True
            cause: RuntimeServiceError = exc
            log.warning("route session %s failed (%s: %s); restoring it", self.session_id, type(exc).__name__, exc)
        # The route has been silent since the request went out (a step deadline already spent part of it).
        await self._reopen(position, sent + wait_s, cause)
        try:
            return await make()
        except DeadlineExpired as exc:  # restored, then silent again: UNAVAILABLE, as for a silent route
            self._needs_replay = True
            raise ShardUnavailable(f"{exc}; the session is kept and is replayed at its next call: retry shortly") \
                from exc
        except RuntimeServiceError:
            self._needs_replay = True
            raise

    async def _reopen(self, position: int, deadline: float, cause: RuntimeServiceError | None = None) -> None:
        """Restore the session (`_restore`), retrying while the route does not answer, until `deadline`.

        Args:
            deadline: when to give up (monotonic); an attempt still running then is cut off.
            cause: the failure that left the session to restore; with it, nothing starts past `deadline`.
        Raises:
            ShardUnavailable: the route did not answer in time (or the server is stopping); the session is kept.
            InvalidRequest, PoolExhausted: the workers refuse the session (waiting will not help).
        """
        r, p = self.route, self.route.pipeline
        while cause is None or (time.monotonic() < deadline and not r.is_closed):
            try:  # cut off at the deadline: a hung worker answers nothing, not even the reconnect
                await asyncio.wait_for(self._restore(position), max(0.0, deadline - time.monotonic()))
                return
            except (InvalidRequest, PoolExhausted):
                raise
            except asyncio.TimeoutError:
                before = f" (before that, {type(cause).__name__}: {cause})" if cause is not None else ""
                cause = DeadlineExpired(f"restoring the session got no answer within the recovery timeout "
                                        f"({r.recovery_timeout_s:g} s){before}")
            except RuntimeServiceError as exc:
                cause = exc
            await asyncio.sleep(max(0.0, min(r.retry_interval_s, deadline - time.monotonic())))
        raise ShardUnavailable(
            f"the shard route {','.join(p.addresses)} is not answering ({type(cause).__name__}: {cause}); "
            "the session is kept and is replayed when every worker is back: retry shortly"
        ) from cause

    async def _restore(self, position: int) -> None:
        """One attempt: open the session at a newer epoch and replay the log's first `position` tokens."""
        p, g = self.route.pipeline, self.geometry
        if self._epoch:  # supersede the broken incarnation on every worker
            if p.epoch <= self._epoch:
                p.advance_epoch()
            await p.connect()  # re-check the route (a restarted worker must run the same layers)
        # Taken before the SessionOpen goes out: an attempt cut off here may still be open on a busy worker
        # (it frees it behind its running steps), so the next attempt must supersede it, never reuse its epoch.
        self._epoch = p.epoch
        await p.open(self.session_id, g.sink, g.window, max_block=g.max_block, max_rollback=g.max_rollback)
        tokens = self.log[:position]
        for i in range(0, len(tokens), REPLAY_CHUNK):
            await p.forward(self.session_id, tokens[i : i + REPLAY_CHUNK], all_logits=False)
        if tokens:
            log.info("route session %s restored at epoch %d (%d tokens replayed)", self.session_id, self._epoch,
                     len(tokens))
        self._needs_replay = False
