"""The scheduler's cost model: bucketed moving averages, interpolation, the append budget."""

from inference_engine.runtime.cost_model import CostModel


def test_buckets_interpolate_and_extrapolate():
    m = CostModel(48)
    assert m.buckets == [1, 2, 4, 8, 16, 32, 48]
    assert m.estimate(3) is None
    m.observe(1, 0.010)
    assert m.estimate(1) == 0.010 and m.estimate(4) == 0.040  # unseen above: every row as dear as the known ones
    m.observe(7, 0.016)  # bucket 8, a point at 7 rows
    assert abs(m.estimate(4) - 0.010 - 3 / 6 * 0.006) < 1e-12 and abs(m.estimate(14) - 0.032) < 1e-12
    m.observe(8, 0.026)  # slower than the point: rows 0.5 * 7 + 0.5 * 8, seconds 0.5 * 0.016 + 0.5 * 0.026
    assert abs(m.estimate(8) - 0.021 * 8 / 7.5) < 1e-12
    m.observe(8, 0.011)  # quicker: rows 0.8 * 7.5 + 0.2 * 8, seconds 0.8 * 0.021 + 0.2 * 0.011
    assert abs(m.estimate(8) - 0.019 * 8 / 7.6) < 1e-12
    m.observe(0, 5.0)  # a forward of no rows says nothing (and must not become a point at 0 rows)
    assert abs(m.estimate(8) - 0.019 * 8 / 7.6) < 1e-12 and m.estimate(1) == 0.010


def test_more_rows_are_never_estimated_cheaper_than_fewer():
    """A stale cheap point above a fresh dear one (a 4-row point left from start-up under a 1-row point
    that the streams keep refreshing) must not make rows in between look cheaper than one row alone."""
    m = CostModel(64)
    m.observe(4, 0.0085)
    m.observe(1, 0.0112)
    assert m.estimate(2) == m.estimate(4) == 0.0112
    assert m.append_budget(1, 63, 2.0, fallback=16) < 63  # not every row: 4 rows cost at least one


def test_an_estimate_follows_the_rows_the_scheduler_keeps_choosing():
    """A stale cheap point must not keep predicting a larger batch cheap (the head-of-line regression:
    one 5-row forward measured at 18 ms, then 9-row forwards at 140 ms were estimated at ~24 ms
    for ever, since their observations went to bucket 16 while the estimate of 9 leaned on bucket 8)."""
    m = CostModel(64)
    m.observe(1, 0.0166)
    m.observe(5, 0.0176)  # bucket 8
    m.observe(268 // 4, 0.268)  # a prompt's forward, bucket 64
    for _ in range(30):
        m.observe(9, 0.140)  # bucket 16
    assert m.estimate(9) > 0.12
    assert m.append_budget(1, 63, 2.0, fallback=16) < 8  # 9 rows no longer fit twice a 1-row step


def test_append_budget_keeps_the_stream_gap_within_the_slack():
    m = CostModel(64)
    assert m.append_budget(1, 63, 2.0, fallback=16) == 16  # nothing learnt yet
    for rows, seconds in ((1, 0.02), (2, 0.021), (4, 0.022), (8, 0.03), (16, 0.045), (32, 0.08), (64, 0.16)):
        m.observe(rows, seconds)
    budget = m.append_budget(1, 63, 2.0, fallback=16)
    assert m.estimate(1 + budget) <= 0.04 < m.estimate(2 + budget) and budget >= 8
    assert m.append_budget(7, 57, 2.0, fallback=16) > budget  # more streams: a longer forward is allowed
    assert m.append_budget(1, 1, 2.0, fallback=16) == 1  # an append always progresses


def test_the_streams_base_ignores_a_moment_of_slowness():
    """A stream's 1-row periods rose from 8 to 14 ms for the 20 steps before an append (the bench's client
    building the append beside the server); the moving average followed, the append's slices were then held
    to twice 14 ms and the stream's gaps reached 3x its usual 8. The base is a low quantile of the bucket's
    recent periods, so it stays near 8 ms, and the budget with it."""
    m = CostModel(64)
    for _ in range(8):
        m.observe(6, 0.016)  # bucket 8: six rows cost twice one
    for _ in range(44):
        m.observe(1, 0.008)
    for _ in range(20):
        m.observe(1, 0.014)
    assert m.estimate(1) > 0.013 and abs(m.base(1) - 0.008) < 1e-12
    assert m.append_budget(1, 63, 1.5, fallback=16) < m.append_budget(1, 63, 2.0, fallback=16) <= 5
    few = CostModel(64)
    few.observe(1, 0.010)
    assert few.base(1) == few.estimate(1) == 0.010  # too few periods: the estimate
