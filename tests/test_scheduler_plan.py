"""The engine loop's plan is data, and its thread crossings are counted.

The plan tests use fake jobs and a fake backend (no model; fixtures labelled below); the
crossing tests run real appends and Generate calls through a `Runtime` over the tiny model.
"""

import asyncio
import time

import pytest

from inference_engine.runtime.engine import Engine
from inference_engine.runtime.job import Job, Kind, Phase
from inference_engine.runtime.plan import Plan, Why
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.scheduler import Scheduler
from inference_engine.runtime.types import AppendParams, CreateSessionParams, GenerateParams
from inference_engine.execution.executor import Block
from tests.conftest import make_config
from tests.kernel_guard import assert_full_tile

HANG_GUARD_S = 60.0  # a wait that only ends a hung test


class FakeSession:
    """TEST FIXTURE: what a plan reads of a session (its tag)."""

    def __init__(self, tag: str):
        self.tag = tag


class FakeBackend:
    """TEST FIXTURE: a forward that computes nothing."""

    def forward(self, blocks, wait=False):
        time.sleep(0.001)
        return [None] * len(blocks)


class Stream(Job):
    """TEST FIXTURE: a Generate whose client takes each step at once (one row per step)."""

    kind = Kind.DECODE

    def __init__(self):
        super().__init__(FakeSession("stream"))
        self.steps = 0

    def plan(self, budget):
        return Block("stream", (1,), False)

    def update(self, result):
        self.steps += 1

    def abort(self, exc):
        self.phase = Phase.DONE


class Append(Job):
    """TEST FIXTURE: an append of `tokens` rows."""

    def __init__(self, tag: str, tokens: int):
        super().__init__(FakeSession(tag))
        self.left, self._planned = tokens, 0

    @property
    def remaining(self) -> int:
        return self.left

    def plan(self, budget):
        self._planned = min(budget, self.left)
        return Block(self.session.tag, (0,) * self._planned, False)

    def update(self, result):
        self.left -= self._planned
        if not self.left:
            self.phase = Phase.DONE

    def abort(self, exc):
        self.phase = Phase.DONE


def wait_until(done, timeout_s: float = HANG_GUARD_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.002)
    return done()


def test_every_row_of_a_forward_is_named_with_its_rule():
    sched = Scheduler(lambda: FakeBackend(), max_rows=64)
    plans: list[Plan] = []
    sched.on_plan.append(plans.append)
    stream, prompt, long = Stream(), Append("prompt", 40), Append("long", 100_000)
    try:
        sched.start(stream)
        assert wait_until(lambda: stream.steps >= 2)
        sched.start(prompt)
        assert wait_until(lambda: prompt.is_done)
        sched.start(long)
        assert wait_until(lambda: long.left < 100_000 - 200)
        stream.cancel()
        sched.wake()
        assert wait_until(lambda: stream.is_done)
        seen = len(plans)
        assert wait_until(lambda: len(plans) >= seen + 3)
    finally:
        long.cancel()
        sched.wake()
        sched.close()
    described = [p.describe() for p in plans]
    assert described[0] == [("stream", 1, "decode")]  # the stream alone
    # The new prompt goes whole beside the stream (its time to first token), beyond the fallback budget.
    with_prompt = [p for p in plans if any(r.job is prompt for r in p.rows)]
    assert len(with_prompt) == 1, described
    assert with_prompt[0].describe() == [("stream", 1, "decode"), ("prompt", 40, "finishing")]
    assert with_prompt[0].budget is not None and with_prompt[0].budget < 40 and with_prompt[0].streams == 1
    # The long append is sliced within the budget the stream leaves, then fills the forward alone.
    beside = [p for p in plans if p.is_streaming and any(r.job is long for r in p.rows)]
    alone = [p for p in plans if not p.is_streaming]
    assert beside and all(r.why is Why.SLICE and len(r.block.tokens) <= p.budget
                          for p in beside for r in p.rows if r.job is long), described
    assert alone and all(p.describe() == [("long", 64, "fill")] and p.budget is None for p in alone), described
    assert all(p.n_rows <= 64 for p in plans)


@pytest.fixture(scope="module")
def engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=4))
    yield e
    e.close()


async def _crossings(engine: Engine, append_tokens: int, steps: int) -> tuple[int, int]:
    """Crossings of one AppendTokens of `append_tokens` tokens, then of one greedy Generate of `steps` steps."""
    runtime = Runtime(engine, make_config())
    created = await runtime.create_session(CreateSessionParams((), "crossings", 0, 0))
    count = engine.scheduler.crossings
    before = count.total()
    await runtime.append_tokens(AppendParams(created.session_id, tuple(range(3, 3 + append_tokens))))
    appended = count.total()
    chunks = []

    async def emit(chunk) -> None:
        chunks.append(chunk)

    await runtime.generate(GenerateParams(created.session_id, max_new_tokens=steps, ignore_eos=True), emit)
    generated = count.total()
    assert sum(len(c.tokens) for c in chunks) == steps and chunks[-1].stop_reason is not None
    await runtime.close_session(created.session_id)
    return appended - before, generated - appended


@pytest.mark.parametrize("append_tokens", [5, 40])  # one chunk, and several (a chunk is 16 rows here)
def test_an_append_crosses_threads_twice_and_a_decode_step_twice(engine, append_tokens):
    """An append: its start and its result (taking it ends the job on the loop side, no engine round trip).
    A Generate of n steps: its start, each step to the stream and the stream's take back, its end."""
    append, generate = asyncio.run(_crossings(engine, append_tokens, steps=6))
    assert append == 2
    assert generate == 2 * 6 + 2


def test_taking_an_append_wakes_the_engine_only_for_a_call_waiting_on_its_session():
    """The loop side ends a taken append itself; the engine thread hears of it only when a call (a describe,
    a close) waits for that session's clean point, and that call then runs."""
    sched = Scheduler(lambda: FakeBackend(), max_rows=64)
    session, other = FakeSession("s"), FakeSession("t")

    class Computed(Append):  # TEST FIXTURE: its result waits for the caller, as AppendJob's does
        def plan(self, budget):
            return None if self.phase is Phase.HANDING else super().plan(budget)

        def update(self, result):
            self.left -= self._planned
            if not self.left:
                self.phase = Phase.HANDING

    async def main() -> None:
        first, second = Computed("s", 10), Computed("s", 10)
        first.session = second.session = session
        sched.start(first)
        assert await asyncio.to_thread(wait_until, lambda: first.phase is Phase.HANDING)
        before = sched.crossings.to_engine
        first.phase = Phase.DONE  # the caller took it
        sched.settled(session)
        assert sched.crossings.to_engine == before  # no call waits: no wake
        sched.start(second)
        assert await asyncio.to_thread(wait_until, lambda: second.phase is Phase.HANDING)
        described = sched.submit(lambda: "described", session=session)
        unrelated = await asyncio.wait_for(sched.submit(lambda: "other", session=other), HANG_GUARD_S)
        assert unrelated == "other" and not described.done()  # it waits for the append to be taken
        before = sched.crossings.to_engine
        second.phase = Phase.DONE
        sched.settled(session)
        assert sched.crossings.to_engine == before + 1
        assert await asyncio.wait_for(described, HANG_GUARD_S) == "described"

    try:
        asyncio.run(main())
    finally:
        sched.close()
