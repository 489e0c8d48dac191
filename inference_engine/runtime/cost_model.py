"""How long a forward of m rows takes, learnt from the engine's own iterations.

The scheduler uses it to size the append rows it mixes into a batch while sessions are
streaming: as many as keep the iteration within `slack` times what the decode rows alone
would take, so a long append never stretches a stream's inter-token gap by more than that.
Costs are kept per power-of-two bucket of rows (an exponential moving average of seconds
per iteration) and interpolated; a bucket never seen is extrapolated from the largest one
seen below it as if every row cost as much as that bucket's average row (pessimistic for
the exact kernel, whose cost grows slower than its rows).
"""

from __future__ import annotations

import bisect


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
        self.seconds: dict[int, float] = {}  # bucket -> moving average

    def _bucket(self, rows: int) -> int:
        return self.buckets[min(bisect.bisect_left(self.buckets, rows), len(self.buckets) - 1)]

    def observe(self, rows: int, seconds: float) -> None:
        """Record one forward of `rows` rows that took `seconds`."""
        b = self._bucket(rows)
        old = self.seconds.get(b)
        self.seconds[b] = seconds if old is None else (1 - self.decay) * old + self.decay * seconds

    def estimate(self, rows: int) -> float | None:
        """Seconds a forward of `rows` rows is expected to take (None before any observation at or below it)."""
        known = sorted(self.seconds)
        below = [b for b in known if b <= rows]
        above = [b for b in known if b >= rows]
        if not below:
            return None
        lo = below[-1]
        if not above:
            return self.seconds[lo] * rows / lo
        hi = above[0]
        if hi == lo:
            return self.seconds[lo]
        f = (rows - lo) / (hi - lo)
        return self.seconds[lo] + f * (self.seconds[hi] - self.seconds[lo])

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
        base = self.estimate(decode_rows)
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
