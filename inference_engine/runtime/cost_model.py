"""How long a forward of m rows takes, learnt from the engine's own iterations.

The scheduler uses it to size the append rows it mixes into a batch while sessions are
streaming: as many as keep the iteration within `slack` times what the decode rows alone
would take, so a long append never stretches a stream's inter-token gap by more than that.
An observation is a stream's period as the engine sees it: from the moment the streams of one
forward are planned (planning waits for the previous forward: their next tokens come from its
logits) to the same moment of the next forward carrying streams. It holds that forward's
compute, the hand-over of its steps and the loop's own time, so it is counted against that
forward's rows. (Timing from one iteration's start to the next counted the previous forward
instead, a greedy step's compute overlapping its hand-over; with the batch size changing between
iterations the points drifted, and a long append's slices reached 3x the stream's idle gap.) A
period is dropped when a plain call ran in it (opening the appending session took ~20 ms once,
counted into a 1-row point no 1-row forward could correct while the append lasted), when the
engine waited longer than a hand-over (a slow client), or when a forward without streams came
between.

Costs are kept per power-of-two bucket of rows, as a point: the moving averages of the rows
and of the seconds of the iterations that fell in it. A forward slower than its bucket's
average moves it faster (SLOWER_DECAY) than a quicker one: a stream's gap is at stake.
Estimates interpolate between the points at their own rows, not at the buckets' bounds: an
iteration of 9 rows counts as 9 rows, so when the scheduler keeps choosing 9 the 9-row
estimate follows what they cost (with the bound 16 as its abscissa, a stale 8-row point would
keep predicting 9 rows cheap however slow they ran: an append then took 140 ms slices beside
a 20 ms stream). An estimate is never below that of fewer rows (a stale cheap point above a
fresh dear one says nothing). Beyond the largest point every row costs as much as that
point's average row (pessimistic for the exact kernel, whose cost grows slower than its rows).
"""

from __future__ import annotations

import bisect
from collections import deque

SLOWER_DECAY = 0.5  # weight of an observation above its bucket's average (else `decay`)
RECENT = 64  # periods kept per bucket for `base`
BASE_QUANTILE = 0.25  # `base`: this quantile of them
BASE_MIN_SEEN = 8  # fewer recent periods: `base` is the estimate


class CostModel:
    """Seconds per forward as a function of its rows."""

    def __init__(self, max_rows: int, decay: float = 0.2):
        """
        Args:
            max_rows: the largest forward (the batch bound).
            decay: weight of a new observation in its bucket's moving average.
        """
        self.buckets = [1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows]
        if self.buckets[-1] != max_rows:
            self.buckets.append(max_rows)
        self.decay = decay
        self.points: dict[int, tuple[float, float]] = {}  # bucket -> moving averages (rows, seconds)
        self.recent: dict[int, deque[float]] = {}  # bucket -> its last RECENT periods (seconds)

    def _bucket(self, rows: int) -> int:
        return self.buckets[min(bisect.bisect_left(self.buckets, rows), len(self.buckets) - 1)]

    def observe(self, rows: int, seconds: float) -> None:
        """Record one forward of `rows` rows that took `seconds` (a forward of no rows says nothing)."""
        if rows < 1:
            return
        b = self._bucket(rows)
        self.recent.setdefault(b, deque(maxlen=RECENT)).append(seconds)
        old = self.points.get(b)
        a = self.decay if old is None or seconds <= old[1] else max(self.decay, SLOWER_DECAY)
        self.points[b] = (rows, seconds) if old is None else ((1 - a) * old[0] + a * rows, (1 - a) * old[1] + a * seconds)

    def estimate(self, rows: int) -> float | None:
        """Seconds a forward of `rows` rows is expected to take (None before any observation at or below it)."""
        known = sorted(self.points.values())
        below = [p for p in known if p[0] <= rows]
        above = [p for p in known if p[0] >= rows]
        if not below:
            return None
        floor = max(p[1] for p in below)  # more rows never cost less
        lo_rows, lo_s = below[-1]
        if not above:
            return max(floor, lo_s * rows / lo_rows)
        hi_rows, hi_s = above[0]
        if hi_rows == lo_rows:
            return max(floor, lo_s)
        return max(floor, lo_s + (rows - lo_rows) / (hi_rows - lo_rows) * (hi_s - lo_s))

    def base(self, rows: int) -> float | None:
        """What the streams' own `rows` take, for the slack rules: a low quantile of their bucket's recent
        periods (a moment's slowness, such as a client busy next to the server just before an append, must
        not raise the bar the append's slices are held to while no forward of these rows alone runs), or
        the estimate while few are known."""
        recent = sorted(self.recent.get(self._bucket(rows), ()))
        if len(recent) < BASE_MIN_SEEN:
            return self.estimate(rows)
        return recent[int(BASE_QUANTILE * (len(recent) - 1))]

    def append_budget(self, decode_rows: int, room: int, slack: float, fallback: int) -> int:
        """Append rows to add to `decode_rows` so the forward stays within `slack` times theirs alone.

        Args:
            decode_rows: rows of the streaming sessions this iteration (>= 1).
            room: rows left under the batch bound.
            slack: how much longer than a decode-only forward an iteration may take.
            fallback: the budget while the model knows too little.
        Returns:
            1..room rows (at least one, so an append always progresses).
        """
        base = self.base(decode_rows)
        if base is None or room <= 1:
            return max(1, min(fallback, room))
        limit = slack * base
        best = 1
        for extra in range(1, room + 1):
            cost = self.estimate(decode_rows + extra)
            if cost is None or cost > limit:
                break
            best = extra
        return best
