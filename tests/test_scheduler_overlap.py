"""The scheduler runs each job's `overlap` after handing the forward to the backend and before taking
its result (a constraint's next masks are computed there, beside the forward); a job whose overlap fails
gets the failure as its result and ends alone, its companions untouched.

Fake jobs and a fake backend (no model), as in test_scheduler_handoff.py.
"""

import time

from inference_engine.execution.executor import Block
from inference_engine.runtime.job import Job, Kind, Phase
from inference_engine.runtime.scheduler import Scheduler

HANG_GUARD_S = 60.0


class RecordingBackend:
    """TEST FIXTURE: a backend whose forwards return at once, recording the order of events."""

    def __init__(self, events: list):
        self.events = events

    def forward(self, blocks, wait=False):
        self.events.append(("forward", tuple(b.executor for b in blocks)))
        return [f"logits of {b.executor}" for b in blocks]


class Stepper(Job):
    """TEST FIXTURE: a decode job of `steps` one-row steps that records its overlap and update calls."""

    kind = Kind.DECODE

    def __init__(self, name: str, steps: int, events: list, fail_overlap_at: int | None = None):
        super().__init__(session=None)
        self.name, self.left, self.events, self.fail_overlap_at = name, steps, events, fail_overlap_at
        self.results: list = []
        self.ended_with: BaseException | None = None

    def plan(self, budget):
        if not self.left:
            self.phase = Phase.DONE
            return None
        return Block(self.name, (1,), False)

    def overlap(self):
        self.events.append(("overlap", self.name))
        if self.left == self.fail_overlap_at:
            raise RuntimeError(f"{self.name}: overlap failed")

    def update(self, result):
        self.events.append(("update", self.name))
        if isinstance(result, BaseException):
            raise result
        self.results.append(result)
        self.left -= 1

    def abort(self, exc):
        self.ended_with = exc
        self.phase = Phase.DONE


def _run(jobs, events):
    sched = Scheduler(lambda: RecordingBackend(events), max_rows=8)
    try:
        for job in jobs:
            sched.start(job)
        deadline = time.monotonic() + HANG_GUARD_S
        while not all(j.is_done for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        sched.close()


def test_overlap_runs_between_the_forward_and_its_update():
    events: list = []
    a, b = Stepper("a", 3, events), Stepper("b", 3, events)
    _run([a, b], events)
    forwards = [i for i, e in enumerate(events) if e[0] == "forward" and "a" in e[1]]
    assert forwards
    for i in forwards:
        names = events[i][1]
        after = events[i + 1: i + 1 + 2 * len(names)]
        assert after == [("overlap", n) for n in names] + [("update", n) for n in names], events
    assert a.results == ["logits of a"] * 3 and b.results == ["logits of b"] * 3


def test_a_failed_overlap_is_that_jobs_result_alone():
    events: list = []
    bad, good = Stepper("bad", 3, events, fail_overlap_at=2), Stepper("good", 3, events)
    _run([bad, good], events)
    assert isinstance(bad.ended_with, RuntimeError) and "overlap failed" in str(bad.ended_with)
    assert bad.results == ["logits of bad"]  # its first step; the failed one committed nothing
    assert good.results == ["logits of good"] * 3 and good.ended_with is None
