"""The engine loop: schedule → execute → update, on the one thread that runs MLX.

Each iteration gathers the ready work of every session into one backend forward: the
next decode step of every streaming Generate, speculative verify blocks, and the next chunk
of each pending AppendTokens. Within the forward each row attends to its own session's cache,
and the matmuls are row-invariant, so a session's bits never depend on its companions.

Rows per iteration are bounded (`max_rows`, at most the probed tile). Generate jobs go
first, then appends, each kind in rotating order; while any Generate is streaming, appends
get only as many rows as keep the iteration within GAP_SLACK times what the streams' rows
would take alone (`cost_model.py`, learnt from the loop's own iterations), so a long append
never starves the decoders; a prompt that fits the rows left goes whole (its TTFT). Jobs
started while the streams' plans wait for their last forward join the forward being planned.

Between iterations the loop runs plain calls (`run`: create a session, describe it, ...).
A call tied to a session (`run_quiescent`) waits until that session's job is at a clean
point (a Generate with every step handed to its stream; an append finished), so it never
sees work no client was sent.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import mlx.core as mx

from inference_engine.errors import EngineShutdown, EngineUnavailable
from inference_engine.runtime.cost_model import CostModel
from inference_engine.session.session import Session
from inference_engine.verifier.executor import Backend, Block

T = TypeVar("T")
log = logging.getLogger(__name__)
STATS_EVERY_S = 30.0  # how often the loop logs its batch sizes (when it did any work)
GAP_SLACK = 2.0  # while streams run, an iteration may take this many times what their rows alone would
FINISH_SLACK = 2.5  # ... or this many, for an append that completes in it (a new session's prompt: TTFT)
HANDOFF_WAIT_S = 0.01  # a forward waits at most this long for streams handing over a step to rejoin it
IDLE_S = 0.02  # a longer wait for work (a slow client, no work) ends the stream period being timed


class Job(ABC):
    """One call's work on one session, advanced by the scheduler one block at a time (engine thread)."""

    is_decoder: bool = False  # streams tokens (scheduled first; limits appends' share)
    remaining: int = 0  # rows still to compute (appends), for the finishing rule

    @property
    def is_ready(self) -> bool:
        """It has a block to plan now (a stream is not, while its client takes its last step)."""
        return True

    def __init__(self, session: Session):
        self.session = session
        self.is_cancelled = False  # set from any thread; takes effect at the job's next iteration
        self.is_done = False  # the job has finished (set by the job on the engine thread)
        self.queued_at = time.monotonic()  # when the job was started; None once its first block ran
        self.has_run = False  # its first block has been planned

    def cancel(self) -> None:
        """Stop at the next iteration (thread-safe)."""
        self.is_cancelled = True

    @abstractmethod
    def plan(self, budget: int) -> Block | None:
        """This iteration's block (at most `budget` rows), or None to sit this one out."""

    @abstractmethod
    def update(self, result: object) -> None:
        """Take the planned block's result (logits or the exception that stopped it)."""

    @abstractmethod
    def abort(self, exc: BaseException | None) -> None:
        """End now: undo what no client saw succeed; `exc` is why (None: cancelled). Sets is_done."""

    @property
    def is_quiescent(self) -> bool:
        """Nothing computed for this job is unsent: a describe would show only what clients saw."""
        return self.is_done


@dataclass
class _Call:
    """A plain call queued for the engine thread."""

    fn: Callable[..., object]
    args: tuple[object, ...]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    session: Session | None = None  # run only when this session's job is quiescent


@dataclass
class BatchStats:
    """Rows per iteration since the last report."""

    iterations: int = 0
    rows: int = 0
    max_rows: int = 0
    sessions: int = 0
    since: float = field(default_factory=time.monotonic)

    def add(self, rows: int, sessions: int) -> None:
        self.iterations += 1
        self.rows += rows
        self.sessions += sessions
        self.max_rows = max(self.max_rows, rows)


class Scheduler:
    """Owns the engine thread: plain calls and jobs, batched into one forward per iteration."""

    def __init__(self, backend: Callable[[], Backend], max_rows: int, append_rows: int = 0, name: str = "mlx-engine",
                 clock: Callable[[], float] = time.perf_counter):
        """
        Args:
            backend: the engine's current backend (read at every iteration).
            max_rows: most rows in one forward (the probed tile at most).
            append_rows: append rows per iteration while a Generate streams; 0 = as many as
                keep the iteration within GAP_SLACK times the streams' rows alone (learnt).
            clock: seconds, for the cost model's periods and the forwards' timings (a test's
                virtual clock makes them exact, whatever the machine's load).
        """
        self._backend = backend
        self._clock = clock
        self.max_rows = max_rows
        self.append_rows = min(append_rows, max_rows)
        self.cost = CostModel(max_rows)
        self._last: tuple[int, float] | None = None  # rows of the last forward with streams, and when they were planned
        self._hold_until: float | None = None  # waiting for streams mid-hand-over until then (monotonic)
        self._hold: float | None = None  # the next wait's timeout (streams mid-hand-over)
        self._calls: deque[_Call] = deque()
        self._deferred: list[_Call] = []
        self._new_jobs: deque[Job] = deque()
        self._jobs: list[Job] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._is_closed = False
        self.stats = BatchStats()
        self.observers: list[Callable[[int, int, float], None]] = []  # (rows, sessions, seconds) per forward
        self.on_queue_wait: Callable[[float], None] | None = None  # seconds a job waited for its first block
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- from the event loop --------------------------------------------------------------

    def submit(self, fn: Callable[..., T], *args: object, session: Session | None = None) -> asyncio.Future[T]:
        """Queue `fn(*args)` for the engine thread; its future resolves on the running loop.

        Args:
            session: run only once this session's job (if any) is quiescent.
        Raises:
            EngineUnavailable: the scheduler is closed.
        """
        loop = asyncio.get_running_loop()
        call = _Call(fn, args, loop.create_future(), loop, session)
        with self._lock:
            if self._is_closed:
                raise EngineUnavailable("the engine is shutting down; retry against a live server")
            self._calls.append(call)
        self._wake.set()
        return call.future

    async def run(self, fn: Callable[..., T], *args: object, session: Session | None = None) -> T:
        """Run `fn(*args)` on the engine thread and return its result.

        If the awaiting task is cancelled, the call still completes before the cancellation
        propagates, so state it mutates is never left half-updated.
        """
        fut = self.submit(fn, *args, session=session)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    def start(self, job: Job) -> None:
        """Add a job; it is planned from the next iteration on.

        Raises:
            EngineUnavailable: the scheduler is closed.
        """
        with self._lock:
            if self._is_closed:
                raise EngineUnavailable("the engine is shutting down; retry against a live server")
            self._new_jobs.append(job)
        self._wake.set()

    def wake(self) -> None:
        """Something a job waits for happened (e.g. a stream took its tokens)."""
        self._wake.set()

    def close(self) -> None:
        """Refuse new work, abort running jobs, finish queued calls, stop the thread (blocking)."""
        with self._lock:
            self._is_closed = True
        self._wake.set()
        self._thread.join()

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            waiting = self._clock()
            self._wake.wait(self._hold)
            if self._clock() - waiting > IDLE_S:  # longer than a hand-over: not the last forward's cost
                self._last = None
            self._hold = None
            self._wake.clear()
            with self._lock:
                calls, self._calls = list(self._calls), deque()
                self._jobs.extend(self._new_jobs)
                self._new_jobs.clear()
                closing = self._is_closed
            self._deferred.extend(calls)
            if closing:
                for job in self._jobs:
                    self._finish(job, EngineShutdown("the engine is shutting down"))
                self._jobs = []
            self._run_ready_calls(closing)
            if closing and not self._deferred:
                mx.synchronize()  # nothing of this thread's may still run in MLX when it ends (mlx#3126)
                return
            if self._iterate_or_fail():
                self._wake.set()  # there may be more to do: go round again without sleeping

    def _iterate_or_fail(self) -> bool:
        """`_iterate`, containing a fault of the loop itself (not of one job, which `_iterate` keeps to
        that job): the jobs it was running end with the error (their clients get INTERNAL and nothing
        they did not see succeed is kept), and the thread lives on for every later call and job."""
        try:
            return self._iterate()
        except Exception as exc:  # noqa: BLE001 - the engine thread must survive its own faults
            log.exception("an engine loop iteration failed; ending the %d jobs it was running", len(self._jobs))
            for job in self._jobs:
                if not job.is_done:
                    self._finish(job, exc)
            self._jobs = []
            self._last = None
            return True

    def _run_ready_calls(self, closing: bool) -> None:
        busy = {id(j.session): j for j in self._jobs}
        waiting = []
        for call in self._deferred:
            job = busy.get(id(call.session)) if call.session is not None else None
            if job is not None and not job.is_quiescent and not closing:
                waiting.append(call)
                continue
            self._last = None  # the time until the next forward is not the last forward's cost alone
            try:
                result, error = call.fn(*call.args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result, error = None, exc
            call.loop.call_soon_threadsafe(resolve, call.future, result, error)
        self._deferred = waiting

    def _iterate(self) -> bool:
        """One schedule → execute → update pass; whether any job advanced."""
        started = self._clock()
        for job in list(self._jobs):
            if job.is_cancelled and not job.is_done:
                self._finish(job, None)
        running = [j for j in self._jobs if not j.is_done]
        ended = len(running) < len(self._jobs)  # calls waiting for those sessions may run now
        self._jobs = running
        if not self._jobs:
            self._last = None
            return ended
        planned: list[tuple[Job, Block]] = []
        decoders = [j for j in self._jobs if j.is_decoder]
        appends = [j for j in self._jobs if not j.is_decoder]
        # Streams whose last step is still being handed to their clients rejoin within a moment:
        # wait for them (HANDOFF_WAIT_S at most) rather than split the streams over two forwards,
        # or give appends a forward the late streams would wait behind.
        late = sum(1 for j in decoders if not j.is_ready)
        if late and (late < len(decoders) or appends):
            now = time.monotonic()
            if self._hold_until is None:
                self._hold_until = now + HANDOFF_WAIT_S
            if now < self._hold_until:
                self._hold = self._hold_until - now
                return ended
        self._hold_until = None
        ended |= self._plan(decoders, self.max_rows, planned)
        # Planning the streams waited for their last forward (their next tokens come from its
        # logits): jobs started meanwhile join this forward rather than wait for the next one.
        joined = self._join_new_jobs()
        ended |= self._plan([j for j in joined if j.is_decoder], self.max_rows - sum(len(b.tokens) for _, b in planned),
                            planned)
        decoders += [j for j in joined if j.is_decoder]
        appends += [j for j in joined if not j.is_decoder]
        planned_at = self._clock()  # the streams read their last forward's logits: it is done
        streaming = bool(planned)
        if streaming and self._last is not None:  # a stream's period: that forward, its hand-over, this plan
            self.cost.observe(self._last[0], planned_at - self._last[1])
        rows = sum(len(b.tokens) for _, b in planned)
        # A stream still mid-hand-over sits this iteration out; it counts as a row, so appends
        # never get a forward it would wait behind.
        streams = rows + sum(1 for j in decoders if not j.is_done and all(j is not p for p, _ in planned))
        room = self.max_rows - rows
        if streams and room > 0 and appends:
            budget = (min(self.append_rows, room) if self.append_rows
                      else self.cost.append_budget(streams, room, GAP_SLACK, fallback=max(1, room // 4)))
            first = self._finishing(appends, streams, budget, room)
            if first is not None:  # it completes in this iteration: it goes first, whole
                ended |= self._plan([first], first.remaining, planned)
                appends = [j for j in appends if j is not first]
                room -= sum(len(b.tokens) for j, b in planned if j is first)
            room = min(budget, room)
        ended |= self._plan(appends, room, planned)
        self._rotate()
        if not planned:
            return ended or any(j.is_done for j in self._jobs)
        rows = sum(len(b.tokens) for _, b in planned)
        results = self._backend().forward([b for _, b in planned], wait=False)
        for (job, _), result in zip(planned, results):
            try:
                job.update(result)
            except BaseException as exc:  # noqa: BLE001 - one session's failure stays its own
                self._finish(job, exc)
        self._last = (rows, planned_at) if streaming else None
        self._account(rows, len(planned), self._clock() - started)
        return True

    def _join_new_jobs(self) -> list[Job]:
        """The jobs started since the loop last took them, now part of this iteration (unless closing)."""
        with self._lock:
            if self._is_closed or not self._new_jobs:
                return []
            joined = list(self._new_jobs)
            self._new_jobs.clear()
        self._jobs.extend(joined)
        return joined

    def _finishing(self, appends: list[Job], streams: int, budget: int, room: int) -> Job | None:
        """The append that completes in this iteration, first and whole, if any; it exceeds `budget` but fits `room`.

        A prompt that has not started (a new session's, or a new turn's) goes whole: sliced into
        budget-sized pieces it adds the same work to the streams' iterations, only spread over
        several, while its time to first token grows with every slice (3.3x idle beside 7 streams).
        The rest of a long append goes whole only within FINISH_SLACK of the streams alone, so a
        long append stays sliced to its end.
        """
        if self.append_rows:
            return None
        fitting = [j for j in appends if budget < j.remaining <= room]
        if not fitting:
            return None
        fresh = [j for j in fitting if not j.has_run]
        if fresh:
            return min(fresh, key=lambda j: j.remaining)
        short = min(fitting, key=lambda j: j.remaining)
        base, whole = self.cost.base(streams), self.cost.estimate(streams + short.remaining)
        if base is None or whole is None or whole > FINISH_SLACK * base:
            return None
        return short

    def _plan(self, jobs: list[Job], room: int, planned: list[tuple[Job, Block]]) -> bool:
        """Plan `jobs` in turn within `room` rows, appending to `planned`; whether any job ended."""
        ended = False
        for job in jobs:
            if room <= 0:
                break
            try:
                block = job.plan(room)
            except BaseException as exc:  # noqa: BLE001 - one session's failure stays its own
                self._finish(job, exc)
                ended = True
                continue
            if block is None:
                if job.is_cancelled and not job.is_done:  # it gave up while planning (e.g. its session closed)
                    self._finish(job, None)
                    ended = True
                continue
            planned.append((job, block))
            room -= len(block.tokens)
            if not job.has_run:
                job.has_run = True
                if self.on_queue_wait is not None:
                    self.on_queue_wait(time.monotonic() - job.queued_at)
        return ended

    def _finish(self, job: Job, exc: BaseException | None) -> None:
        try:
            job.abort(exc)
        except BaseException:  # noqa: BLE001 - the job must end whatever happens
            log.exception("aborting a job of session %s failed", job.session.tag)
        job.is_done = True

    def _rotate(self) -> None:
        """Move the first job of each kind to the back (fair turns when the budget is short)."""
        for kind in (True, False):
            first = next((j for j in self._jobs if j.is_decoder == kind), None)
            if first is not None:
                self._jobs.remove(first)
                self._jobs.append(first)

    def _account(self, rows: int, sessions: int, seconds: float) -> None:
        self.stats.add(rows, sessions)
        for observe in self.observers:
            observe(rows, sessions, seconds)
        now = time.monotonic()
        if now - self.stats.since >= STATS_EVERY_S:
            s = self.stats
            log.info("engine loop: %d iterations in %.0fs, %.1f rows and %.1f sessions per iteration (max %d rows)",
                     s.iterations, now - s.since, s.rows / s.iterations, s.sessions / s.iterations, s.max_rows)
            self.stats = BatchStats()


def resolve(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    """Settle `future` with `result` or `error` (on its loop; a no-op if it is already settled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
