"""Items handed in by many event-loop tasks, computed on the engine thread in as few calls as they allow.

A shard worker's sessions each send their blocks on their own streams; the blocks of one
scheduler iteration of the route's client reach the worker within one event-loop turn. The
queue hands the engine thread one call (`run_many`) that takes every item waiting when it
runs: the submit is deferred to the end of the current loop turn, so items queued in that
turn go together, and items that arrive while the engine computes go together in its next
call. No timer: a lone item waits one loop turn at most.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Generic, Sequence, TypeVar

from inference_engine.runtime.scheduler import Scheduler

I = TypeVar("I")
O = TypeVar("O")


class BatchQueue(Generic[I, O]):
    """Runs `run_many` over the items waiting at once, on the scheduler's engine thread."""

    def __init__(self, scheduler: Scheduler, run_many: Callable[[Sequence[I]], list[O | BaseException]]):
        """
        Args:
            scheduler: owns the engine thread (its plain calls).
            run_many: per item its result or its exception, in order (engine thread; never raises).
        """
        self._scheduler = scheduler
        self._run_many = run_many
        self._lock = threading.Lock()  # filled on the event loop, emptied on the engine thread
        self._waiting: list[tuple[I, asyncio.Future]] = []
        self._is_queued = False  # a call that will take the queue is on its way to the engine thread
        self.calls = 0  # engine calls made (each one forward, or one per item that cannot share)

    async def run(self, item: I) -> O:
        """`item`'s result, computed with whatever other items wait with it.

        If the awaiting task is cancelled, the item still completes before the cancellation
        propagates, so state it mutates is never left half-updated.

        Raises:
            What `run_many` returns for the item; EngineUnavailable once the scheduler is closed.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._lock:
            self._waiting.append((item, future))
            is_queued, self._is_queued = self._is_queued, True
        if not is_queued:
            loop.call_soon(self._submit)  # after the tasks woken in this loop turn have queued theirs
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            if not future.cancelled():
                future.exception()  # retrieved: its caller gave up on it
            raise

    def _submit(self) -> None:
        try:
            call = self._scheduler.submit(self._take_and_run)
        except Exception as exc:  # noqa: BLE001 - the engine is closed: everyone waiting gets why
            with self._lock:
                waiting, self._waiting, self._is_queued = self._waiting, [], False
            for _, future in waiting:
                if not future.done():
                    future.set_exception(exc)
            return
        call.add_done_callback(self._hand_out)

    def _take_and_run(self) -> tuple[list[tuple[I, asyncio.Future]], list[O | BaseException]]:
        """Engine thread: every item waiting now, in one `run_many`."""
        with self._lock:
            waiting, self._waiting, self._is_queued = self._waiting, [], False
        self.calls += 1
        try:
            return waiting, self._run_many([item for item, _ in waiting])
        except Exception as exc:  # noqa: BLE001 - run_many answers per item; this is a broken engine
            return waiting, [exc] * len(waiting)

    @staticmethod
    def _hand_out(call: asyncio.Future) -> None:
        """Event loop: each item's result to its waiter."""
        waiting, results = call.result()  # _take_and_run never raises; a closing scheduler still runs calls
        for (_, future), result in zip(waiting, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
