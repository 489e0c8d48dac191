"""The scheduler never gives appends a forward that a stream handing over its last step would wait behind.

Fake jobs and a fake backend (no model): a stream whose client takes each step a few ms
after it is produced, and a long append. Before the fix, every iteration that found the
stream mid-hand-over gave the append the whole batch (64 rows), and the stream's next step
waited behind that forward (a 25x inter-token gap on the real model).

Nothing here depends on the machine's speed: how long the scheduler waits for a stream
handing over (HANDOFF_WAIT_S) is set to a hang guard or to zero, so each test sees one
behaviour whatever the load; costs are read from a virtual clock that only the fake forwards
and calls advance.
"""

import asyncio
import threading
import time

import pytest

from inference_engine.runtime import policy as policy_module
from inference_engine.runtime.job import Job, Kind, Phase
from inference_engine.runtime.scheduler import Scheduler
from inference_engine.execution.executor import Block

HANG_GUARD_S = 60.0  # a wait that only ends a hung test


class VirtualClock:
    """TEST FIXTURE: seconds that pass only when a fake forward or call says so (the scheduler's `clock`)."""

    def __init__(self):
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds

    def advance_to(self, when: float) -> None:
        with self._lock:
            self.now = max(self.now, when)


class FakeBackend:
    def __init__(self, clock: VirtualClock | None = None, cost=lambda rows: 0.002):
        self.forwards: list[list[tuple[str, int]]] = []  # while the stream runs
        self.stream: Job | None = None
        self.clock, self.cost = clock, cost  # a forward of `rows` rows takes cost(rows) virtual seconds

    def forward(self, blocks, wait=False):
        if not self.stream.is_done:
            self.forwards.append([(b.executor, len(b.tokens)) for b in blocks])
        if self.clock is not None:
            self.clock.advance(self.cost(sum(len(b.tokens) for b in blocks)))
        time.sleep(0.002)
        return [None] * len(blocks)


@pytest.fixture
def patient(monkeypatch):
    """Streams handing over a step are always waited for (the bound of that wait is a hang guard)."""
    monkeypatch.setattr(policy_module, "HANDOFF_WAIT_S", HANG_GUARD_S)


class Stream(Job):
    kind = Kind.DECODE

    def __init__(self, steps: int, take_after_s: float, after_step=lambda left: None):
        super().__init__(session=None)
        self.left, self.take_after_s = steps, take_after_s
        self.after_step = after_step  # called with the steps left after each step (engine thread)
        self.scheduler: Scheduler | None = None

    @property
    def handing(self) -> bool:
        return self.phase is Phase.HANDING

    @property
    def is_quiescent(self) -> bool:
        return not self.handing

    @property
    def is_handing_over(self) -> bool:
        return self.handing

    def plan(self, budget):
        if self.handing:
            return None
        if not self.left:
            self.phase = Phase.DONE
            return None
        return Block("stream", (1,), False)

    def update(self, result):
        self.left -= 1
        self.phase = Phase.HANDING
        self.after_step(self.left)
        self.timer = threading.Timer(self.take_after_s, self._taken)  # the client takes the step a little later
        self.timer.daemon = True
        self.timer.start()

    def _taken(self):
        if self.phase is Phase.HANDING:
            self.phase = Phase.RUNNING
        self.scheduler.wake()

    def abort(self, exc):
        self.phase = Phase.DONE


class Append(Job):
    def __init__(self, tokens: int):
        super().__init__(session=None)
        self.left, self._planned, self.planned = tokens, 0, 0  # planned: blocks planned so far

    @property
    def remaining(self) -> int:  # rows still to compute (the finishing rule reads it)
        return self.left

    def plan(self, budget):
        if not self.left:
            self.phase = Phase.DONE
            return None
        self._planned = min(budget, self.left)
        self.planned += 1
        return Block("append", (0,) * self._planned, False)

    def update(self, result):
        self.left -= self._planned

    def abort(self, exc):
        self.phase = Phase.DONE


def wait_until(done, timeout_s: float = HANG_GUARD_S) -> bool:
    """Poll `done()` until it holds or `timeout_s` passes (a hang guard); its last value."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.005)
    return done()


def _run(append_rows: int) -> list[list[tuple[str, int]]]:
    """A 40-step stream, and a long append started after its 5th step; the forwards while the stream ran."""
    clock = VirtualClock()
    backend = FakeBackend(clock, cost=lambda rows: 0.001 * (1 + rows))  # rows are dear: the learnt budget is small
    sched = Scheduler(lambda: backend, max_rows=64, append_rows=append_rows, clock=clock)
    append = Append(tokens=100_000)
    stream = Stream(steps=40, take_after_s=0.003, after_step=lambda left: left == 35 and sched.start(append))
    stream.scheduler, backend.stream = sched, stream
    try:
        sched.start(stream)
        assert wait_until(lambda: stream.is_done), "the stream did not finish"
    finally:
        append.cancel()
        sched.wake()
        sched.close()
    return backend.forwards


def test_appends_keep_their_share_while_the_stream_hands_over(patient):
    forwards = _run(append_rows=4)
    with_append = [f for f in forwards if any(kind == "append" for kind, _ in f)]
    assert with_append, "the append never ran"
    assert max(rows for f in with_append for kind, rows in f if kind == "append") <= 4
    streamed = sum(1 for f in forwards if any(kind == "stream" for kind, _ in f))
    assert streamed == 40 == len(forwards)  # the append never went alone while the stream handed over a step
    assert len(with_append) == 35  # from the stream's 6th step on, in every one of its forwards


def test_learnt_budget_never_hands_the_whole_batch_to_an_append_beside_a_stream(monkeypatch):
    monkeypatch.setattr(policy_module, "HANDOFF_WAIT_S", 0.0)  # never wait: the append runs while the stream hands over
    forwards = _run(append_rows=0)  # the cost model's budget
    alone = [rows for f in forwards for kind, rows in f if kind == "append" and len(f) == 1]
    assert alone, forwards  # the stream mid-hand-over sat those out ...
    assert all(rows < 64 for rows in alone), alone  # ... and still counted as a row


def test_a_stream_that_does_not_rejoin_is_waited_for_only_so_long():
    """The wait for a stream handing over its step is bounded (HANDOFF_WAIT_S): a client that takes its
    step late delays the other streams by that much at most, never until it comes back."""
    backend = FakeBackend()
    sched = Scheduler(lambda: backend, max_rows=64)
    slow, quick = Stream(steps=2, take_after_s=10 * HANG_GUARD_S), Stream(steps=20, take_after_s=0.0)
    slow.scheduler = quick.scheduler = sched
    backend.stream = quick
    try:
        sched.start(slow)
        assert wait_until(lambda: slow.handing)  # its first step is out; its client keeps it
        sched.start(quick)
        assert wait_until(lambda: quick.is_done), "the quick stream waited for the slow one"
        assert slow.left == 1 and slow.handing
    finally:
        slow.timer.cancel()
        slow.cancel()
        sched.wake()
        sched.close()
    assert backend.forwards == [[("stream", 1)]] * 21  # the slow stream's step, then the quick one's 20 alone


def test_streams_handing_over_at_different_moments_stay_in_one_forward(patient):
    """Two streams whose clients take their steps 1 ms and 4 ms after each forward: before, the first to
    rejoin got a forward of its own and the streams drifted apart (two forwards per step, half the rows each)."""
    backend = FakeBackend()
    sched = Scheduler(lambda: backend, max_rows=64)
    quick, slow = Stream(steps=30, take_after_s=0.001), Stream(steps=30, take_after_s=0.004)
    quick.scheduler = slow.scheduler = sched
    backend.stream = slow
    try:
        sched.start(quick)
        sched.start(slow)
        assert wait_until(lambda: quick.is_done and slow.is_done)
    finally:
        sched.close()
    together = sum(1 for f in backend.forwards if len(f) == 2)
    assert together >= 29, backend.forwards  # every step but the first and the last, at most


def test_a_fault_of_the_loop_ends_its_jobs_and_the_engine_thread_lives_on():
    """A failure outside any one job (here the cost model, planning an append beside a stream) must not
    kill the engine thread: before, every running and later call hung for ever."""
    backend = FakeBackend()
    sched = Scheduler(lambda: backend, max_rows=64)
    aborted: list[BaseException | None] = []

    class Failing(Stream):
        def abort(self, exc):
            aborted.append(exc)
            super().abort(exc)

    def broken_budget(*args, **kwargs):
        raise ZeroDivisionError("a bug in the loop")

    sched.cost.append_budget = broken_budget
    stream, append = Failing(steps=1000, take_after_s=0.0), Append(tokens=1000)
    stream.scheduler, backend.stream = sched, stream
    try:
        sched.start(stream)
        sched.start(append)
        assert wait_until(lambda: stream.is_done and append.is_done)
        assert len(aborted) == 1 and isinstance(aborted[0], ZeroDivisionError)

        async def call() -> int:
            return await asyncio.wait_for(sched.run(lambda: 41 + 1), timeout=10)

        assert asyncio.run(call()) == 42  # the thread still serves calls
    finally:
        sched.close()


def test_a_new_prompt_beside_streams_goes_whole_and_a_long_append_stays_sliced():
    """A prompt that fits the rows left runs in one forward with the streams (its TTFT), where the
    learnt budget would have sliced it; a long append beside the same stream keeps its small slices."""
    backend = FakeBackend()
    sched = Scheduler(lambda: backend, max_rows=64)
    sched.cost.observe(1, 0.002)
    sched.cost.observe(64, 0.200)  # rows are dear: the budget beside one stream is 1 row ...
    sched.cost.observe = lambda rows, seconds: None  # ... and stays so, whatever the fake forwards take
    prompt, long = Append(tokens=40), Append(tokens=100_000)
    steps = 10**6  # the stream runs until the test ends it
    stream = Stream(steps=steps, take_after_s=0.001, after_step=lambda left: left == steps - 3 and sched.start(prompt))
    stream.scheduler, backend.stream = sched, stream
    try:
        sched.start(stream)
        assert wait_until(lambda: prompt.is_done)
        sched.start(long)
        assert wait_until(lambda: long.planned >= 3)
    finally:
        stream.cancel()
        long.cancel()
        sched.wake()
        sched.close()
    appended = [rows for f in backend.forwards for kind, rows in f if kind == "append"]
    assert appended[0] == 40  # the prompt, whole
    assert len(appended) >= 4 and max(appended[1:]) < 40  # the long append, sliced


def test_calls_run_between_forwards_are_not_counted_as_their_cost():
    """A plain call (opening a session, describing one) that runs between two forwards must not be
    counted in the first forward's cost. Before, the ~20 ms of opening the appending session went
    into the 1-row point just as the append began; no 1-row forward ran while it lasted, so the point
    stayed 1.8x the real cost and the append's slices took 3x the stream's idle gap."""
    clock = VirtualClock()
    backend = FakeBackend(clock)  # every forward takes 2 ms of the virtual clock
    sched = Scheduler(lambda: backend, max_rows=64, clock=clock)
    seen: list[float] = []
    observe = sched.cost.observe
    sched.cost.observe = lambda rows, seconds: (seen.append(seconds), observe(rows, seconds))
    stream = Stream(steps=10**6, take_after_s=0.0)  # runs until the test ends it
    stream.scheduler, backend.stream = sched, stream

    async def calls() -> None:
        for _ in range(5):
            await sched.run(clock.advance, 0.1)  # a call that takes 100 ms

    try:
        sched.start(stream)
        assert wait_until(lambda: len(backend.forwards) >= 3)
        asyncio.run(calls())  # between the stream's forwards
        after = len(backend.forwards)
        assert wait_until(lambda: len(backend.forwards) >= after + 3)  # ... which went on after them
    finally:
        stream.cancel()
        sched.wake()
        sched.close()
    assert clock() >= 5 * 0.1 + len(backend.forwards) * 0.002 - 1e-9  # every call and forward was timed
    assert seen and seen == pytest.approx([0.002] * len(seen)), seen  # each period is its forward alone


def test_a_job_started_while_the_streams_plan_joins_that_forward():
    """Planning a stream waits for its last forward (its next token comes from those logits); a job
    started meanwhile now joins the forward being planned instead of waiting for the next one (a new
    session's prompt and first Generate step each waited one more forward beside 7 streams)."""
    backend = FakeBackend()
    sched = Scheduler(lambda: backend, max_rows=64)
    prompt, joined_at = Append(tokens=40), []

    class Waiting(Stream):
        def plan(self, budget):
            block = super().plan(budget)
            if block is not None and self.left == 10:  # the job arrives while this plan waits
                sched.start(prompt)
                joined_at.append(len(backend.forwards))  # the forward being planned
            return block

    stream = Waiting(steps=20, take_after_s=0.001)
    stream.scheduler, backend.stream = sched, stream
    try:
        sched.start(stream)
        assert wait_until(lambda: stream.is_done and prompt.is_done)
    finally:
        sched.close()
    assert joined_at and [kind for kind, _ in backend.forwards[joined_at[0]]] == ["stream", "append"], backend.forwards


def test_each_forward_is_charged_its_own_rows_when_the_batch_size_changes():
    """A greedy stream's step is handed over while its forward computes; the next plan waits for that
    forward. The cost model must charge each forward's compute to its own rows: timing from one
    iteration's start to the next charged the previous forward (a 2-row iteration after an 8-row one
    looked as dear as 8 rows, and the 8-row one as cheap as 2), so the points drifted."""
    per_row = 0.003
    clock = VirtualClock()

    class Computing(FakeBackend):  # dispatch returns at once; the rows' compute ends per_row x rows later
        done_at = 0.0

        def forward(self, blocks, wait=False):
            self.done_at = clock() + per_row * sum(len(b.tokens) for b in blocks)
            return [None] * len(blocks)

        def wait(self):
            clock.advance_to(self.done_at)

    class Reading(Stream):  # planning reads the last forward's logits
        def plan(self, budget):
            if not self.handing and self.left:
                backend.wait()
            return super().plan(budget)

    class Alternating(Append):  # 1 row, then 7, then 1, ...
        turn = 0

        def plan(self, budget):
            self.turn += 1
            self._planned = 1 if self.turn % 2 else 7
            return Block("append", (0,) * self._planned, False)

    backend = Computing()
    sched = Scheduler(lambda: backend, max_rows=64, append_rows=8, clock=clock)
    stream, append = Reading(steps=80, take_after_s=0.0), Alternating(tokens=10**9)
    stream.scheduler, backend.stream = sched, stream
    try:
        sched.start(stream)
        sched.start(append)
        assert wait_until(lambda: stream.is_done)
    finally:
        append.cancel()
        sched.wake()
        sched.close()
    two, eight = sched.cost.estimate(2), sched.cost.estimate(8)
    assert (two, eight) == pytest.approx((2 * per_row, 8 * per_row))
