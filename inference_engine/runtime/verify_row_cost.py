"""What one more row of a verification block costs, as a fraction of a one-row step (measured once).

Prompt lookup proposes single-token matches only where extra rows are nearly free. A draft
pays off when it is accepted more often than its row costs, and single-token matches are
accepted far less often than longer ones (on the bench's copy-back prompt 7 of 41 against 63 of
112 for 2- and 3-token matches). Memory-bound forwards take them (the fp32 weights here: five
rows cost ~1.1x one), compute-bound ones do not (the q4_1 kernel here: ~1.9x). Like the tile
probe, this is measured on each platform at start-up, never assumed. Drafts change only how
many tokens a step commits, never which: the target verifies every one.
"""

from __future__ import annotations

import statistics
import time

from inference_engine.decoding.drafter import PromptLookupDrafter
from inference_engine.runtime.engine import Engine

CHEAP_ROW = 0.1  # single-token matches are proposed at or below this marginal cost per row
ROWS = 5  # the measured block: a step and 4 drafts (the default K)


def measure_verify_row_cost(engine: Engine, reps: int = 5) -> float:
    """The marginal cost of a verification row: (t(ROWS rows) / t(1 row) - 1) / (ROWS - 1), >= 0.

    Runs ROWS-row and 1-row blocks on a scratch session (median of `reps` each, after a
    warm-up) on the calling thread: call it before the engine thread serves.
    """
    v = engine.make_verifier(sink=4, window=64)
    v.prefill(list(range(1, 17)))

    def median_s(rows: int) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            v.forward_block(list(range(20, 20 + rows)), all_logits=True)  # evaluated (wait=True)
            times.append(time.perf_counter() - t)
            v.commit_or_truncate(forwarded=rows, accepted=0)
        return statistics.median(times)

    median_s(ROWS)  # warm-up
    one, many = median_s(1), median_s(ROWS)
    return max(0.0, (many / one - 1) / (ROWS - 1))


def lookup_drafter(row_cost: float | None) -> PromptLookupDrafter:
    """Prompt lookup for a verification row of `row_cost` (None: not measured; longer matches only)."""
    cheap = row_cost is not None and row_cost <= CHEAP_ROW
    return PromptLookupDrafter(min_ngram=1 if cheap else 2)
