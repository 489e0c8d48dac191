"""Continuous batching: a session's bits never depend on who else is running.

Each scenario (a session's own sink/window, prompt and script of appends and greedy /
prompt-lookup / draft-model generations) is run alone on an idle server, then all of them
at once with staggered starts (sessions joining and leaving mid-stream), through real
gRPC. Every stream and every digest after every step must be bitwise the solo one, and
the engine must really have put several sessions' rows into one forward.
"""

from __future__ import annotations

import pytest

from inference_engine.runtime.engine import Engine
from tests.batching_helpers import DRAFT, GREEDY, LOOKUP, Scenario, assert_batch_invariant
from tests.batching_helpers import random_tokens as _tokens
from tests.draft_models import dequantized_q4_draft
from tests.kernel_guard import assert_full_tile, tiny_drafted_engine


@pytest.fixture(scope="module")
def engine(tiny):
    e = tiny_drafted_engine(tiny)
    yield e
    e.close()


async def test_tiny_mix_is_batch_invariant(engine):
    loop = (5, 17, 33, 2, 250, 9) * 4  # prompt lookup finds matches
    scenarios = [
        Scenario(2, 8, _tokens(1, 12, 256), (("gen", 60, GREEDY, 1),)),
        Scenario(3, 16, loop, (("gen", 12, LOOKUP, 4), ("append", _tokens(2, 40, 256)), ("gen", 10, GREEDY, 1)), 0.01),
        Scenario(1, 6, _tokens(3, 30, 256), (("append", _tokens(4, 3, 256)), ("gen", 16, DRAFT, 3)), 0.02),
        Scenario(4, 32, _tokens(5, 50, 256), (("gen", 8, LOOKUP, 8), ("gen", 8, GREEDY, 1))),
    ]
    assert await assert_batch_invariant(engine, scenarios) >= 2


async def test_small_batches_and_append_shares_change_nothing(engine):
    """Rows per forward bounded to 3 (appends 1 row while decoding): same bits, more iterations."""
    scenarios = [
        Scenario(2, 8, _tokens(6, 20, 256), (("gen", 40, GREEDY, 1), ("append", _tokens(7, 9, 256)))),
        Scenario(2, 8, _tokens(8, 25, 256), (("gen", 40, LOOKUP, 4),)),
    ]
    small = assert_full_tile(Engine(engine.loaded, exact=True, max_tile=16, plain_block=64, max_rollback=8,
                                    max_batch_rows=3, append_rows=1))
    try:
        assert await assert_batch_invariant(small, scenarios) >= 2
    finally:
        small.close()


@pytest.mark.real_model
async def test_real_model_mix_is_batch_invariant(real_model, real_model_path):
    """Greedy, lookup and draft sessions with appends, three window sizes, wraps and rollbacks, at the full
    block of 64 rows (the server's default tile: prompts go in 64-row chunks, batches up to 64 rows). The draft
    session's drafter is the q4 model's weights in fp32 (tests/draft_models.py: its 150-token catch-up in 4-bit
    products took 25 s of each of the two runs)."""
    draft = dequantized_q4_draft(real_model_path)
    engine = assert_full_tile(Engine(real_model, exact=True, max_tile=64, plain_block=64, max_rollback=8, draft=draft))
    v = real_model.spec.vocab_size
    copy = _tokens(11, 12, v) * 3
    scenarios = [
        Scenario(4, 32, _tokens(10, 40, v), (("gen", 24, GREEDY, 1), ("append", _tokens(12, 20, v)), ("gen", 8, GREEDY, 1))),
        Scenario(4, 64, copy, (("gen", 20, LOOKUP, 4), ("gen", 12, GREEDY, 1)), 0.3),
        Scenario(2, 200, _tokens(13, 90, v), (("append", _tokens(14, 60, v)), ("gen", 16, DRAFT, 4)), 0.6),
    ]
    try:
        assert await assert_batch_invariant(engine, scenarios) >= 2
    finally:
        engine.close()
