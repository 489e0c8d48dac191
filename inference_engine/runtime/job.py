"""A scheduler job: one call's request state on one session, advanced one block per iteration.

A job's state is one `Phase`, not a set of flags: WAITING (started, no block run yet),
RUNNING (it has a block to plan), HANDING (a result is out to the event loop and not yet
taken; nothing to plan until it is) and DONE. The job moves itself between them on the
engine thread, except HANDING → RUNNING / DONE, which the loop side does when it takes the
result (under the job's lock, ordered against the engine's `abort`). Cancellation is a
request from any thread (`cancel`), acted on at the job's next iteration.

`Crossings` counts the hand-offs between the event loop and the engine thread (a job or call
queued, a wake, a result posted back): the cost the engine loop's design is measured by
(docs/architecture.md states them per append and per decode step; tests check them).
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from enum import Enum
from typing import Callable

from inference_engine.session.session import Session
from inference_engine.execution.executor import Block


class Phase(Enum):
    """Where a job stands."""

    WAITING = "waiting"  # started; no block planned yet (its queue wait is still running)
    RUNNING = "running"  # it has a block to plan at the next iteration
    HANDING = "handing"  # its last result is out to the loop side, not yet taken: nothing to plan
    DONE = "done"  # ended (finished, taken, aborted); the scheduler drops it


class Kind(Enum):
    """What a job feeds the forward: the scheduler's two shares of rows."""

    DECODE = "decode"  # a streaming Generate: its steps go first and set the appends' share
    APPEND = "append"  # an AppendTokens: chunks within what the streams leave


class Crossings:
    """Hand-offs between threads, by direction (thread-safe counters)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.to_engine = 0  # the loop side queued a job or call, or woke the engine thread
        self.to_loop = 0  # the engine thread posted a result (or an end) to an event loop

    def count(self, to_engine: int = 0, to_loop: int = 0) -> None:
        with self._lock:
            self.to_engine += to_engine
            self.to_loop += to_loop

    def total(self) -> int:
        """Crossings in both directions so far."""
        with self._lock:
            return self.to_engine + self.to_loop


class Job(ABC):
    """One call's work on one session (engine thread, but for `cancel` and the loop side's take)."""

    kind: Kind = Kind.APPEND

    def __init__(self, session: Session):
        self.session = session
        self.phase = Phase.WAITING
        self.is_cancelled = False  # a request from any thread; takes effect at the job's next iteration
        self.queued_at = time.monotonic()  # when the job was started (its queue wait ends at its first block)
        self.crossings = Crossings()  # the scheduler's counters, once started

    @property
    def is_done(self) -> bool:
        """The job has ended."""
        return self.phase is Phase.DONE

    @property
    def has_run(self) -> bool:
        """A block of it has been planned."""
        return self.phase is not Phase.WAITING

    @property
    def remaining(self) -> int:
        """Rows still to compute (appends; the finishing rule reads it)."""
        return 0

    @property
    def is_handing_over(self) -> bool:
        """Its result is with the loop side and it will want another block once taken (a stream mid-hand-over:
        the scheduler waits a moment for it rather than split the streams over two forwards)."""
        return False

    @property
    def is_quiescent(self) -> bool:
        """Nothing computed for this job is unsent: a describe would show only what clients saw."""
        return self.is_done

    def cancel(self) -> None:
        """Stop at the next iteration (thread-safe)."""
        self.is_cancelled = True

    @abstractmethod
    def plan(self, budget: int) -> Block | None:
        """This iteration's block (at most `budget` rows), or None to sit this one out."""

    def overlap(self) -> None:
        """Work for the next step that needs no result of this iteration's, run while its forward computes.

        Called between `plan` and `update` for a job with a block in the forward; by default nothing.
        """

    @abstractmethod
    def update(self, result: object) -> None:
        """Take the planned block's result (logits or the exception that stopped it)."""

    @abstractmethod
    def abort(self, exc: BaseException | None) -> None:
        """End now: undo what no client saw succeed; `exc` is why (None: cancelled). Ends in DONE."""

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` on `loop` (from the engine thread), counted as a crossing."""
        self.crossings.count(to_loop=1)
        loop.call_soon_threadsafe(fn, *args)


def resolve(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    """Settle `future` with `result` or `error` (on its loop; a no-op if it is already settled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
