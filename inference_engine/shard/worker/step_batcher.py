"""Gathers the blocks that several sessions have waiting at once into one engine call.

The route's client sends the blocks of one scheduler iteration together, one frame per
session, so they reach a worker within moments of each other. Each session's stream still
runs its own frames in order; the batcher only lets the engine thread take every session's
waiting block in one `step_many` (one forward, each weight read once for all the rows)
instead of one forward per session. A block waits for companions only while sessions of
the previous engine call have not all sent their next block, and at most GATHER_S: a lone
session never waits, a session that stopped costs one such wait, and blocks that arrive
while the engine computes go together in its next call.
Bits cannot change: a row's products and attention never depend on the other rows.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from inference_engine.shard.protocol.errors import ShardUnavailable
from inference_engine.shard.protocol.types import ShardOutput, StepItem
from inference_engine.shard.worker.engine import ShardEngine
from inference_engine.shard.worker.engine_thread import EngineThread

_Waiting = tuple[StepItem, "asyncio.Future[ShardOutput]"]
log = logging.getLogger(__name__)
STATS_EVERY_S = 30.0  # how often the worker logs its blocks per engine call (when it did any work)
GATHER_S = 0.005  # most a block waits for the other sessions of the previous engine call


class StepBatcher:
    """Queues prefill/decode blocks for the engine thread; each engine call takes all that wait."""

    def __init__(self, engine: ShardEngine, thread: EngineThread):
        self.engine = engine
        self.thread = thread
        self._lock = threading.Lock()  # the queue is filled on the event loop, emptied on the engine thread
        self._waiting: list[_Waiting] = []
        self._is_queued = False  # an engine call that will take the queue is on the thread's queue
        self._expected: frozenset[str] = frozenset()  # the sessions of the last engine call
        self._timer: asyncio.TimerHandle | None = None  # the end of the current wait for companions
        self._calls = self._blocks = self._most = 0  # engine calls, blocks, most blocks in one (since _since)
        self._since = time.monotonic()

    async def step(self, item: StepItem) -> ShardOutput:
        """The block's output, computed with whatever other sessions' blocks wait with it.

        As `EngineThread.run`: if the awaiting task is cancelled, the block still completes
        before the cancellation propagates, so the session's state is never half-updated.

        Raises:
            What `prefill` / `decode` raise for this block; ShardUnavailable once the thread is closed.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[ShardOutput] = loop.create_future()
        with self._lock:
            self._waiting.append((item, future))
            is_queued = self._is_queued
            is_complete = self._expected <= {waiting.session_id for waiting, _ in self._waiting}
        if not is_queued:  # else the queued engine call takes this block too
            if is_complete:
                self._submit()
            elif self._timer is None:
                self._timer = loop.call_later(GATHER_S, self._submit)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            if not future.cancelled():
                future.exception()  # retrieved: its caller gave up on it (a client's step deadline)
            raise

    def _submit(self) -> None:
        """Queue an engine call that takes every block waiting when it runs (event loop)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with self._lock:
            if self._is_queued or not self._waiting:
                return
            self._is_queued = True
        try:
            call = self.thread.submit(self._take_and_run)
        except Exception as exc:  # noqa: BLE001 - the thread is closed: everyone waiting gets why
            self._fail_waiting(exc)
            return
        call.add_done_callback(self._hand_out)

    def _fail_waiting(self, exc: BaseException) -> None:
        with self._lock:
            waiting, self._waiting, self._is_queued = self._waiting, [], False
        for _, future in waiting:
            if not future.done():
                future.set_exception(exc)

    def _take_and_run(self) -> tuple[list[_Waiting], list[ShardOutput | BaseException]]:
        """Engine thread: every block waiting now, in one `step_many`."""
        with self._lock:
            waiting, self._waiting, self._is_queued = self._waiting, [], False
            self._expected = frozenset(item.session_id for item, _ in waiting)
        self._account(len(waiting))
        try:
            return waiting, self.engine.step_many([item for item, _ in waiting])
        except Exception as exc:  # noqa: BLE001 - step_many answers per item; this is a broken engine
            return waiting, [exc] * len(waiting)

    def _account(self, blocks: int) -> None:
        self._calls += 1
        self._blocks += blocks
        self._most = max(self._most, blocks)
        now = time.monotonic()
        if now - self._since >= STATS_EVERY_S:
            log.info("shard engine: %d calls in %.0fs, %.2f sessions' blocks per call (max %d)",
                     self._calls, now - self._since, self._blocks / self._calls, self._most)
            self._calls = self._blocks = self._most = 0
            self._since = now

    def _hand_out(self, call: asyncio.Future) -> None:
        """Event loop: each block's result to its waiter."""
        if call.cancelled():  # never started (an executor torn down): nothing was computed
            self._fail_waiting(ShardUnavailable("the shard worker is shutting down"))
            return
        waiting, results = call.result()  # _take_and_run never raises
        for (_, future), result in zip(waiting, results):
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
