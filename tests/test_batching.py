"""Continuous batching: a session's bits never depend on who else is running.

Each scenario (a session's own sink/window, prompt and script of appends and greedy /
prompt-lookup / draft-model generations) is run alone on an idle server, then all of them
at once with staggered starts (sessions joining and leaving mid-stream), through real
gRPC. Every stream and every digest after every step must be bitwise the solo one, and
the engine must really have put several sessions' rows into one forward.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest

from inference_engine.model.loader import random_model
from inference_engine.runtime.engine import Engine
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server

GREEDY, LOOKUP, DRAFT = pb.DECODE_MODE_GREEDY, pb.DECODE_MODE_SPECULATIVE_LOOKUP, pb.DECODE_MODE_SPECULATIVE_DRAFT


@dataclass(frozen=True)
class Scenario:
    """One session's life: geometry, prompt, and steps ("gen", n, mode, k) / ("append", tokens)."""

    sink: int
    window: int
    prompt: tuple[int, ...]
    steps: tuple[tuple, ...]
    delay_s: float = 0.0  # joins this late in the concurrent run


async def _play(stub, sc: Scenario) -> list[tuple]:
    await asyncio.sleep(sc.delay_s)
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=sc.sink, window_tokens=sc.window))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=sc.prompt))
    record = []
    for step in sc.steps:
        if step[0] == "append":
            r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=step[1]))
            record.append(("append", r.history_length))
        else:
            _, n, mode, k = step
            tokens = []
            req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, mode=mode, num_draft_tokens=k)
            async for msg in stub.Generate(req):
                tokens += list(msg.tokens)
            record.append(("gen", tuple(tokens)))
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        record.append((info.history_length, info.state_digest))
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return record


async def assert_batch_invariant(engine: Engine, scenarios: list[Scenario], **server_flags) -> int:
    """Solo and concurrent runs agree bitwise; returns the most sessions seen in one forward."""
    seen = []

    def observe(rows: int, sessions: int, seconds: float) -> None:
        seen.append(sessions)

    engine.scheduler.observers.append(observe)
    try:
        async with running_server(engine, max_sessions=len(scenarios), **server_flags) as (stub, _):
            solo = [await _play(stub, Scenario(s.sink, s.window, s.prompt, s.steps)) for s in scenarios]
            seen.clear()
            together = await asyncio.gather(*(_play(stub, s) for s in scenarios))
    finally:
        engine.scheduler.observers.remove(observe)
    for i, (a, b) in enumerate(zip(solo, together)):
        assert a == b, f"scenario {i} changed when batched"
    return max(seen)


def _tokens(seed: int, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, vocab, n))


@pytest.fixture(scope="module")
def engine(tiny):
    e = Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8, draft=random_model(seed=1))
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
    small = Engine(engine.loaded, exact=True, max_tile=16, plain_block=64, max_rollback=8, max_batch_rows=3,
                   append_rows=1)
    try:
        assert await assert_batch_invariant(small, scenarios) >= 2
    finally:
        small.close()


@pytest.mark.real_model
async def test_real_model_mix_is_batch_invariant(real_model, real_model_path):
    """Greedy, lookup and draft sessions with appends, three window sizes, wraps and rollbacks."""
    from inference_engine.model.loader import load_model

    draft = load_model(real_model_path.parent / "q4")
    engine = Engine(real_model, exact=True, max_tile=16, plain_block=64, max_rollback=8, draft=draft)
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
