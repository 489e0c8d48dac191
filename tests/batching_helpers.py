"""The batching battery's parts: a session's scripted life, played alone and alongside others.

`batch_differences` is the battery's one comparison (solo against concurrent, bitwise, through
real gRPC); `assert_batch_invariant` asserts it finds nothing, and the negative control
(tests/test_negative_controls.py) shows it finds a batch-variant defect.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

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


async def play(stub, sc: Scenario) -> list[tuple]:
    """Run `sc` on a new session; returns every step's result and (history length, state digest) after it."""
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


async def batch_differences(engine: Engine, scenarios: list[Scenario], **server_flags) -> tuple[list[int], int]:
    """Play every scenario alone on an idle server, then all at once (staggered starts).

    Returns:
        (the scenarios whose record differs between the two runs, the most sessions seen in one forward).
    """
    seen = []

    def observe(rows: int, sessions: int, seconds: float) -> None:
        seen.append(sessions)

    engine.scheduler.observers.append(observe)
    try:
        async with running_server(engine, max_sessions=len(scenarios), **server_flags) as (stub, _):
            solo = [await play(stub, Scenario(s.sink, s.window, s.prompt, s.steps)) for s in scenarios]
            seen.clear()
            together = await asyncio.gather(*(play(stub, s) for s in scenarios))
    finally:
        engine.scheduler.observers.remove(observe)
    return [i for i, (a, b) in enumerate(zip(solo, together)) if a != b], max(seen)


async def assert_batch_invariant(engine: Engine, scenarios: list[Scenario], **server_flags) -> int:
    """Solo and concurrent runs agree bitwise; returns the most sessions seen in one forward."""
    changed, most = await batch_differences(engine, scenarios, **server_flags)
    assert not changed, f"scenarios {changed} changed when batched"
    return most


def random_tokens(seed: int, n: int, vocab: int) -> tuple[int, ...]:
    """`n` token ids drawn from [0, vocab) with `seed`."""
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, vocab, n))
