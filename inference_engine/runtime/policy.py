"""Scheduling policy: how one forward's rows are shared between streams and appends.

Every rule the engine loop applies when it plans a forward lives here, with its constants;
the scheduler (`scheduler.py`) only gathers the jobs, asks, and records what it was told.

- Streams (Generate jobs) go first: a stream's gap between tokens is what a client feels.
- While any stream runs, appends get only as many rows as keep the forward within GAP_SLACK
  times what the streams' rows alone take (`append_budget`, from the learnt `CostModel`,
  `cost_model.py`), or a fixed `--append-rows` if one was configured.
- An append that completes in this forward goes whole beyond that budget (`finishing`): a
  prompt that has not started always (its time to first token), the rest of a long one only
  within FINISH_SLACK of the streams alone.
- Streams still handing their last step to their clients are waited for, HANDOFF_WAIT_S at
  most (`hold`), rather than split the streams over two forwards or give appends a forward
  the late streams would wait behind.
- A wait for work longer than IDLE_S ends the stream period being timed: it was a slow client
  or no work, not the last forward's cost.
"""

from __future__ import annotations

from typing import Sequence

from inference_engine.runtime.cost_model import CostModel
from inference_engine.runtime.job import Job

GAP_SLACK = 2.0  # while streams run, a forward may take this many times what their rows alone would
FINISH_SLACK = 2.5  # ... or this many, for an append that completes in it (a new session's prompt: TTFT)
HANDOFF_WAIT_S = 0.01  # a forward waits at most this long for streams handing over a step to rejoin it
IDLE_S = 0.02  # a longer wait for work (a slow client, no work) ends the stream period being timed


class Policy:
    """The rules above, over one engine's learnt cost model."""

    def __init__(self, max_rows: int, append_rows: int = 0):
        """
        Args:
            max_rows: most rows in one forward (the probed tile at most).
            append_rows: append rows per forward while a stream runs; 0 = learnt (`append_budget`).
        """
        self.max_rows = max_rows
        self.append_rows = min(append_rows, max_rows)
        self.cost = CostModel(max_rows)  # seconds per forward by its rows, learnt from stream periods
        self._hold_until: float | None = None  # waiting for streams mid-hand-over until then (monotonic)

    def hold(self, late: int, streams: int, has_appends: bool, now: float) -> float | None:
        """Seconds to wait for `late` of `streams` streams mid-hand-over before planning, or None: plan now.

        A wait starts at the first iteration that finds them late and lasts HANDOFF_WAIT_S at most;
        with every stream late and no append waiting there is nothing to keep apart, so no wait.
        """
        if late and (late < streams or has_appends):
            if self._hold_until is None:
                self._hold_until = now + HANDOFF_WAIT_S
            if now < self._hold_until:
                return self._hold_until - now
        self._hold_until = None
        return None

    def append_budget(self, streams: int, room: int) -> int:
        """Append rows beside `streams` stream rows, within `room` (>= 1: an append always progresses)."""
        if self.append_rows:
            return min(self.append_rows, room)
        return self.cost.append_budget(streams, room, GAP_SLACK, fallback=max(1, room // 4))

    def finishing(self, appends: Sequence[Job], streams: int, budget: int, room: int) -> Job | None:
        """The append that completes in this forward, first and whole, if any: beyond `budget`, within `room`.

        A prompt that has not started (a new session's, or a new turn's) goes whole: sliced into
        budget-sized pieces it adds the same work to the streams' forwards, only spread over
        several, while its time to first token grows with every slice (3.3x idle beside 7 streams).
        The rest of a long append goes whole only within FINISH_SLACK of the streams alone, so a
        long append stays sliced to its end. With a fixed `--append-rows`, nothing goes whole.
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
