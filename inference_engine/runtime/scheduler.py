"""The engine loop: schedule → execute → update, on the one thread that runs MLX.

    plan = self.schedule()                    # which rows run next, and why (a `Plan`, data)
    outputs = self.execute(plan)              # one backend forward for every row of it
    outputs = self.overlap(plan, outputs)     # while it computes: each job's work that needs no logits
    self.update(plan, outputs)                # each job commits its result and hands it to the loop side

A plan gathers the ready work of every session into one forward: the next decode step of
every streaming Generate, speculative verify blocks, and the next chunk of each pending
AppendTokens. Within the forward each row attends to its own session's cache, and the
matmuls are row-invariant, so a session's bits never depend on its companions. How the rows
are shared (streams first; appends within a learnt budget; a prompt that completes goes whole;
a moment's wait for streams handing over a step) is `policy.py`'s; the jobs' request state is
`job.py`'s and `jobs.py`'s.

Between iterations the loop runs plain calls (`run`: create a session, describe it, ...).
A call tied to a session (`run_quiescent`) waits until that session's job is at a clean
point (a Generate with every step handed to its stream; an append finished and taken), so it
never sees work no client was sent.

Thread crossings (`Crossings`, counted here and by the jobs): an append is two, its start and
its result (three when a call waits for its session: the take wakes the loop for it); a decode
step is two, the step to the stream and the stream's take back (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import mlx.core as mx

from inference_engine.errors import EngineShutdown, EngineUnavailable
from inference_engine.runtime import policy
from inference_engine.runtime.cost_model import CostModel
from inference_engine.runtime.job import Crossings, Job, Kind, Phase, resolve
from inference_engine.runtime.plan import Plan, Row, Why
from inference_engine.runtime.policy import Policy
from inference_engine.session.session import Session
from inference_engine.execution.executor import Backend

T = TypeVar("T")
log = logging.getLogger(__name__)
STATS_EVERY_S = 30.0  # how often the loop logs its batch sizes (when it did any work)


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
                keep the iteration within policy.GAP_SLACK times the streams' rows alone (learnt).
            clock: seconds, for the cost model's periods and the forwards' timings (a test's
                virtual clock makes them exact, whatever the machine's load).
        """
        self._backend = backend
        self._clock = clock
        self.policy = Policy(max_rows, append_rows)
        self._last: tuple[int, float] | None = None  # rows of the last forward with streams, and when they were planned
        self._hold: float | None = None  # the next wait's timeout (streams mid-hand-over)
        self._calls: deque[_Call] = deque()
        self._deferred: list[_Call] = []  # calls waiting for their session's job to be quiescent (under _lock)
        self._new_jobs: deque[Job] = deque()
        self._jobs: list[Job] = []
        self._ended = False  # a job ended in this iteration (calls waiting for its session may run)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._is_closed = False
        self.stats = BatchStats()
        self.crossings = Crossings()  # hand-offs between the event loop(s) and this thread
        self.observers: list[Callable[[int, int, float], None]] = []  # (rows, sessions, seconds) per forward
        self.on_plan: list[Callable[[Plan], None]] = []  # every plan, before it is executed
        self.on_queue_wait: Callable[[float], None] | None = None  # seconds a job waited for its first block
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def max_rows(self) -> int:
        """Most rows in one forward."""
        return self.policy.max_rows

    @property
    def append_rows(self) -> int:
        """Fixed append rows beside streams (0: learnt)."""
        return self.policy.append_rows

    @property
    def cost(self) -> CostModel:
        """The learnt cost model the policy reads."""
        return self.policy.cost

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
        self.wake()
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
        job.crossings = self.crossings
        with self._lock:
            if self._is_closed:
                raise EngineUnavailable("the engine is shutting down; retry against a live server")
            self._new_jobs.append(job)
        self.wake()

    def wake(self) -> None:
        """Something a job waits for happened (e.g. a stream took its tokens)."""
        self.crossings.count(to_engine=1)
        self._wake.set()

    def settled(self, session: Session) -> None:
        """The loop side ended a job of `session` (took an append's result): wake the engine thread only if a
        call waits for that session's clean point (nothing else needs it to notice at once)."""
        with self._lock:
            is_waited_for = any(c.session is session for c in self._deferred)
        if is_waited_for:
            self.wake()

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
            if self._clock() - waiting > policy.IDLE_S:  # longer than a hand-over: not the last forward's cost
                self._last = None
            self._hold = None
            self._wake.clear()
            with self._lock:
                self._deferred.extend(self._calls)
                self._calls.clear()
                self._jobs.extend(self._new_jobs)
                self._new_jobs.clear()
                closing = self._is_closed
            if closing:
                for job in self._jobs:
                    self._finish(job, EngineShutdown("the engine is shutting down"))
                self._jobs = []
            self._run_ready_calls(closing)
            if closing and not self._deferred:
                mx.synchronize()  # nothing of this thread's may still run in MLX when it ends (mlx#3126)
                return
            if self._step_or_fail():
                self._wake.set()  # there may be more to do: go round again without sleeping

    def _step_or_fail(self) -> bool:
        """`step`, containing a fault of the loop itself (not of one job, which `step` keeps to that job):
        the jobs it was running end with the error (their clients get INTERNAL and nothing they did not
        see succeed is kept), and the thread lives on for every later call and job."""
        try:
            return self.step()
        except Exception as exc:  # noqa: BLE001 - the engine thread must survive its own faults
            log.exception("an engine loop iteration failed; ending the %d jobs it was running", len(self._jobs))
            for job in self._jobs:
                if not job.is_done:
                    self._finish(job, exc)
            self._jobs = []
            self._last = None
            return True

    def _run_ready_calls(self, closing: bool) -> None:
        # Which calls may run is decided under the lock `settled` takes, so a take that makes a session's
        # job quiescent either comes first (the call runs now) or sees the call waiting (and wakes us).
        with self._lock:
            busy = {id(j.session) for j in self._jobs if not j.is_quiescent} if not closing else set()
            ready = [c for c in self._deferred if c.session is None or id(c.session) not in busy]
            self._deferred = [c for c in self._deferred if c.session is not None and id(c.session) in busy]
        for call in ready:
            self._last = None  # the time until the next forward is not the last forward's cost alone
            try:
                result, error = call.fn(*call.args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result, error = None, exc
            self.crossings.count(to_loop=1)
            call.loop.call_soon_threadsafe(resolve, call.future, result, error)

    def step(self) -> bool:
        """One schedule → execute → update pass; whether there may be more to do at once."""
        started = self._clock()
        self._ended = False
        self._drop_ended()
        if not self._jobs:
            self._last = None
            return self._ended
        plan = self.schedule()
        if plan is None:
            return self._ended or any(j.is_done for j in self._jobs)
        outputs = self.overlap(plan, self.execute(plan))
        self.update(plan, outputs)
        self._account(plan.n_rows, len(plan.rows), self._clock() - started)
        return True

    def schedule(self) -> Plan | None:
        """The next forward's rows, each with its rule (`policy.py`); None: nothing to run now.

        Planning stages each job's block on its session (`Job.plan`); a job that fails to plan ends
        alone. Planning the streams waits for their last forward (their next tokens come from its
        logits), so this is where a stream's period ends and is fed to the cost model.
        """
        decoders = [j for j in self._jobs if j.kind is Kind.DECODE]
        appends = [j for j in self._jobs if j.kind is Kind.APPEND]
        late = sum(1 for j in decoders if j.is_handing_over)
        self._hold = self.policy.hold(late, len(decoders), bool(appends), time.monotonic())
        if self._hold is not None:
            return None
        rows: list[Row] = []
        self._plan(decoders, self.max_rows, rows, Why.DECODE)
        # Jobs started while the streams' plans waited for their last forward join this forward.
        joined = self._join_new_jobs()
        self._plan([j for j in joined if j.kind is Kind.DECODE], self.max_rows - _rows(rows), rows, Why.JOINED)
        decoders += [j for j in joined if j.kind is Kind.DECODE]
        appends += [j for j in joined if j.kind is Kind.APPEND]
        planned_at = self._clock()  # the streams read their last forward's logits: it is done
        if rows and self._last is not None:  # a stream's period: that forward, its hand-over, this plan
            self.cost.observe(self._last[0], planned_at - self._last[1])
        # A stream still mid-hand-over sits this iteration out; it counts as a row, so appends
        # never get a forward it would wait behind.
        streams = _rows(rows) + sum(1 for j in decoders if not j.is_done and all(j is not r.job for r in rows))
        room = self.max_rows - _rows(rows)
        budget: int | None = None
        if streams and room > 0 and appends:
            budget = self.policy.append_budget(streams, room)
            first = self.policy.finishing(appends, streams, budget, room)
            if first is not None:  # it completes in this forward: it goes first, whole
                self._plan([first], first.remaining, rows, Why.FINISHING)
                appends = [j for j in appends if j is not first]
                room -= sum(len(r.block.tokens) for r in rows if r.job is first)
            room = min(budget, room)
        self._plan(appends, room, rows, Why.FILL if budget is None else Why.SLICE)
        self._rotate()
        if not rows:
            return None
        plan = Plan(tuple(rows), streams, budget, planned_at)
        for observe in self.on_plan:
            observe(plan)
        return plan

    def execute(self, plan: Plan) -> list[mx.array | BaseException]:
        """Forward every block of `plan` in one backend call (results may still be computing)."""
        return self._backend().forward([r.block for r in plan.rows], wait=False)

    def overlap(self, plan: Plan, outputs: list[mx.array | BaseException]) -> list[mx.array | BaseException]:
        """Each job's work that needs no logits (a constraint's masks for drafts), while the forward computes.

        The forward was handed to MLX without waiting (`execute`), so this runs beside it. A job that
        fails here gets its failure as its result: `update` then commits nothing of its block.
        """
        outputs = list(outputs)
        for i, row in enumerate(plan.rows):
            try:
                row.job.overlap()
            except BaseException as exc:  # noqa: BLE001 - one session's failure stays its own
                outputs[i] = exc
        return outputs

    def update(self, plan: Plan, outputs: list[mx.array | BaseException]) -> None:
        """Each job commits its result and hands it to the loop side; a job that fails ends alone."""
        for row, result in zip(plan.rows, outputs):
            try:
                row.job.update(result)
            except BaseException as exc:  # noqa: BLE001 - one session's failure stays its own
                self._finish(row.job, exc)
        self._last = (plan.n_rows, plan.planned_at) if plan.is_streaming else None

    def _drop_ended(self) -> None:
        """End the cancelled jobs and drop the ended ones (calls waiting for their sessions may run)."""
        for job in list(self._jobs):
            if job.is_cancelled and not job.is_done:
                self._finish(job, None)
        running = [j for j in self._jobs if not j.is_done]
        self._ended |= len(running) < len(self._jobs)
        self._jobs = running

    def _join_new_jobs(self) -> list[Job]:
        """The jobs started since the loop last took them, now part of this iteration (unless closing)."""
        with self._lock:
            if self._is_closed or not self._new_jobs:
                return []
            joined = list(self._new_jobs)
            self._new_jobs.clear()
        self._jobs.extend(joined)
        return joined

    def _plan(self, jobs: list[Job], room: int, rows: list[Row], why: Why) -> None:
        """Plan `jobs` in turn within `room` rows, appending to `rows`."""
        for job in jobs:
            if room <= 0:
                break
            try:
                block = job.plan(room)
            except BaseException as exc:  # noqa: BLE001 - one session's failure stays its own
                self._finish(job, exc)
                continue
            if block is None:
                if job.is_cancelled and not job.is_done:  # it gave up while planning (e.g. its session closed)
                    self._finish(job, None)
                continue
            rows.append(Row(job, block, why))
            room -= len(block.tokens)
            if job.phase is Phase.WAITING:
                job.phase = Phase.RUNNING
                if self.on_queue_wait is not None:
                    self.on_queue_wait(time.monotonic() - job.queued_at)

    def _finish(self, job: Job, exc: BaseException | None) -> None:
        try:
            job.abort(exc)
        except BaseException:  # noqa: BLE001 - the job must end whatever happens
            log.exception("aborting a job of session %s failed", getattr(job.session, "tag", "?"))
        job.phase = Phase.DONE
        self._ended = True

    def _rotate(self) -> None:
        """Move the first job of each kind to the back (fair turns when the budget is short)."""
        for kind in Kind:
            first = next((j for j in self._jobs if j.kind is kind), None)
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


def _rows(rows: list[Row]) -> int:
    return sum(len(r.block.tokens) for r in rows)
