"""Defects the reliability battery (issue 15) found, each pinned by a deterministic test (tiny model)."""

from __future__ import annotations

import asyncio
import contextlib

from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.types import AppendParams, CreateSessionParams
from tests.conftest import make_config

PROMPT = (5, 17, 33, 2, 250, 9, 9, 120, 64, 3)


def _captured_jobs(engine, monkeypatch) -> list:
    """Every job the engine's scheduler starts from now on (the test's own handle on it)."""
    jobs: list = []
    start = engine.scheduler.start

    def capture(job) -> None:
        jobs.append(job)
        start(job)

    monkeypatch.setattr(engine.scheduler, "start", capture)
    return jobs


async def test_info_never_shows_an_append_whose_caller_left_as_it_completed(tiny_engine, monkeypatch):
    """The caller is cancelled in the instant its append completes: the append is undone, and a
    GetSessionInfo issued right then must not show it (it used to run between the two)."""
    runtime = Runtime(tiny_engine, make_config())
    jobs = _captured_jobs(tiny_engine, monkeypatch)
    sid = (await runtime.create_session(CreateSessionParams((), "", 2, 32))).session_id
    await runtime.append_tokens(AppendParams(sid, PROMPT))
    before = await runtime.session_info(sid)
    task = asyncio.ensure_future(runtime.append_tokens(AppendParams(sid, tuple(range(3, 40)))))
    while len(jobs) < 2 or not jobs[-1].future.done():
        await asyncio.sleep(0)
    task.cancel()  # the caller goes away before it sees the result
    info = await runtime.session_info(sid)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    later = await runtime.session_info(sid)
    assert (info.history_length, info.state_digest) == (before.history_length, before.state_digest)
    assert (later.history_length, later.state_digest) == (before.history_length, before.state_digest)
    await runtime.close_session(sid)
