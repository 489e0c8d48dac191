"""The verification-row cost measured at start-up, and the single-token lookup drafts it enables."""

import math

import pytest

from inference_engine.client import spec_gates as spec_gate
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.types import DecodeMode
from inference_engine.runtime.verify_row_cost import CHEAP_ROW, lookup_drafter, measure_verify_row_cost
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import make_config, running_server

PROMPT = [117] * 16  # the tiny model continues this run, so lookup drafts are accepted (test_speculative)


def test_single_token_matches_only_where_a_row_is_cheap():
    assert lookup_drafter(None).min_ngram == 2  # not measured: longer matches only
    assert lookup_drafter(0.0).min_ngram == lookup_drafter(CHEAP_ROW).min_ngram == 1
    assert lookup_drafter(0.31).min_ngram == 2  # the q4_1 kernel here: five rows ~1.9x one


def test_measured_on_a_scratch_session_and_read_by_the_runtime(real_engine):
    cost = measure_verify_row_cost(real_engine, reps=2)
    assert math.isfinite(cost) and cost >= 0.0
    try:
        for measured, min_ngram in ((0.02, 1), (0.5, 2)):
            real_engine.verify_row_cost = measured
            assert Runtime(real_engine, make_config()).drafters[DecodeMode.SPECULATIVE_LOOKUP].min_ngram == min_ngram
    finally:
        real_engine.verify_row_cost = None


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
async def test_session_gates_with_single_token_drafts(tiny_engine, sampling):
    """Single-token drafts (rejected far more often) change how many tokens a step commits, never which:
    every gate the default lookup passes, it passes too."""
    reports = []
    for row_cost in (None, 0.0):
        async with running_server(tiny_engine) as (stub, runtime):
            runtime.drafters[DecodeMode.SPECULATIVE_LOOKUP] = lookup_drafter(row_cost)
            reports.append(await spec_gate.run_gates(stub, pb, lambda sid: runtime.store.get(sid).history, PROMPT,
                                                     ["lookup"], [1, 4, 8], 24, 3, 8, [sampling]))
    default, single = reports
    assert default.failures == single.failures == 0, "\n".join(single.lines)
    passed = [sum(line.startswith("ok: gate") for line in r.lines) for r in reports]
    assert passed[0] == passed[1] > 0
    assert default.lines != single.lines  # the single-token drafts were proposed (other acceptance counts)
