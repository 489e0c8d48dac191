"""The fallback fork when what it depends on goes away under it, on the tiny model through the real runtime.

A fork cancelled while it is sealed or installed, a client that disconnects while its fork is built,
and the session the fork copies closed before, during or after the copy: each ends with the fork
kept whole or dropped, and nothing else. Every open session is then an entry of the prefix cache or
a session of the test, no pool slot is held by a reservation or a closed session, and the K/V bytes
in use are exactly those of the open sessions (--max-kv-bytes and --prefix-cache-bytes accounting).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from inference_engine.runtime import session_transfer
from inference_engine.runtime.session_transfer import SnapshotParams
from inference_engine.runtime.types import AppendParams, CreateSessionParams
from inference_engine.security.settings import ANONYMOUS
from inference_engine.server.openai_api.fallback_fork import FallbackFork
from tests.openai_helpers import Served, http_api
from tests.test_openai_prefix_fork import PROMPT, REPLY

SETTLE_S = 60.0  # how long a disconnected request may take to end on a loaded machine (a wait, not a measure)


def _is_settled(s: Served) -> bool:
    """No reservation held, no closed session still holding its slab."""
    store = s.runtime.store
    return store.slabs_in_use == len(store.sessions())


def assert_accounted(s: Served, *live: str) -> None:
    """Every open session is a kept entry or one of `live`; slots and bytes are exactly theirs."""
    store, cache = s.runtime.store, s.http.serving.service.cache
    open_ = {x.session_id for x in store.sessions()}
    assert open_ == set(cache._kept) | set(live)
    assert _is_settled(s)  # the pool slot of anything dropped is free
    assert store.kv_bytes_in_use() == sum(x.kv_bytes for x in store.sessions())
    assert cache.kept_bytes() <= s.runtime.config.prefix_cache_bytes
    assert store.kv_bytes_in_use() <= (s.runtime.config.max_kv_bytes or store.kv_bytes_in_use())  # 0: unbounded


async def _prefilled(s: Served) -> str:
    made = await s.runtime.create_session(CreateSessionParams((), "source", 0, 0))
    await s.runtime.append_tokens(AppendParams(made.session_id, tuple(PROMPT)))
    return made.session_id


async def _digest(s: Served, session_id: str) -> str:
    return (await s.http.serving.service.transfer.snapshot(SnapshotParams(session_id, False, ANONYMOUS))).state_digest


def _fork(s: Served) -> FallbackFork:
    service = s.http.serving.service
    return FallbackFork(service.cache, service.transfer, ANONYMOUS, lambda: s.runtime.is_draining)


def _limits(slab: int) -> dict[str, int]:
    """Room for the source and one more session: a slot or bytes leaked by a dropped fork fails the next fork."""
    return dict(max_sessions=2, max_kv_bytes=2 * slab, prefix_cache_bytes=2 * slab)


async def _hold(engine, entered: threading.Event, gate: threading.Event) -> None:
    """Hold the engine thread (`entered` set once it is) until `gate` is set."""
    await engine.run(lambda: (entered.set(), gate.wait()))


async def _slab(engine) -> int:
    async with http_api(engine) as s:
        return s.runtime.store.get(await _prefilled(s)).kv_bytes


@pytest.mark.parametrize("when", ["sealing", "installing", "installing, cancelled twice"])
async def test_a_fork_cancelled_while_it_runs_leaves_nothing_behind(tiny_engine, when, monkeypatch):
    async with http_api(tiny_engine, **_limits(await _slab(tiny_engine))) as s:
        source = await _prefilled(s)
        fork = _fork(s)
        engine, loop = s.runtime.engine, asyncio.get_running_loop()
        entered, gate, closed = threading.Event(), threading.Event(), threading.Event()
        held: list[asyncio.Future] = []
        if when == "sealing":  # the copy's hashing held: the cancel comes while the fork waits for it
            real_seal = session_transfer.seal

            def held_seal(copied):
                entered.set()
                gate.wait()
                return real_seal(copied)

            monkeypatch.setattr(session_transfer, "seal", held_seal)
        else:  # the engine thread held once the slab is prepared: the fork's install call waits in its queue
            real_prepare = engine.prepare_session

            def prepare_then_hold(*args):
                prepared = real_prepare(*args)
                hold = asyncio.run_coroutine_threadsafe(_hold(engine, entered, gate), loop)
                held.append(asyncio.wrap_future(hold, loop=loop))
                entered.wait()  # the hold runs on the engine thread: the install is queued behind it
                return prepared

            monkeypatch.setattr(engine, "prepare_session", prepare_then_hold)
            real_install = session_transfer.install

            def recording_install(*args):  # the coordinator the cancelled install builds, and whether it is closed
                made = real_install(*args)
                real_close = made.close
                made.close = lambda: (closed.set(), real_close())
                return made

            monkeypatch.setattr(session_transfer, "install", recording_install)
        await fork.start(source)  # the state is copied: the task goes on sealing it
        while not entered.is_set() or (when != "sealing" and not engine.scheduler._calls):
            await asyncio.sleep(0.001)
        fork._task.cancel()
        if when.endswith("twice"):  # again, while the cancelled install waits for its call to complete
            for _ in range(5):
                await asyncio.sleep(0)
            fork._task.cancel()
        gate.set()  # the seal or the install runs (a cancelled call still completes): what it built is freed
        await fork.built()
        if held:
            await held[0]
            deadline = loop.time() + SETTLE_S
            while not closed.is_set():  # the install completes on the engine thread, then its slab is freed
                assert loop.time() < deadline, "the cancelled install's coordinator was never closed"
                await asyncio.sleep(0.01)
        assert fork.session_id is None and fork._task.cancelled()
        assert_accounted(s, source)
        assert len(s.runtime.store.sessions()) == 1
        again = _fork(s)  # the slot and the bytes are free for the next fork, which is kept whole
        await again.start(source)
        await again.built()
        assert again.session_id in s.http.serving.service.cache
        assert await _digest(s, again.session_id) == await _digest(s, source)
        assert_accounted(s, source)


async def test_a_client_gone_while_its_fork_is_built_leaves_it_accounted(tiny_engine):
    async with http_api(tiny_engine, max_sessions=6) as s:
        async with s.client() as c:
            stream = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=REPLY, temperature=0,
                                                stream=True)
            async for _ in stream:  # the first token: the fork's state was copied before it
                break
            await stream.close()  # the client goes away while the reply (and maybe the fork) runs
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_S
        while not (_is_settled(s) and len(s.runtime.store.sessions()) == len(s.http.serving.service.cache)):
            assert loop.time() < deadline, "the disconnected request never gave its sessions back"
            await asyncio.sleep(0.01)
        assert_accounted(s)
        await s.http.stop(0.5)  # shutdown closes what was kept: nothing leaked
        assert s.runtime.store.slabs_in_use == 0 and s.runtime.store.kv_bytes_in_use() == 0


@pytest.mark.parametrize("when", ["before", "while", "after"])
async def test_the_source_closed_under_a_fork_ends_whole_or_dropped(tiny_engine, when):
    """`before` the fork reads it: dropped; `after` the copy: kept from its own copy, bitwise the source's
    state; `while` the capture waits for the engine thread: either, never a crash or a damaged entry."""
    async with http_api(tiny_engine, **_limits(await _slab(tiny_engine))) as s:
        source = await _prefilled(s)
        want = await _digest(s, source)
        fork = _fork(s)
        entered, gate = threading.Event(), threading.Event()
        if when == "while":  # the engine thread held, so the fork's capture call waits in its queue
            held = asyncio.ensure_future(s.runtime.engine.run(lambda: (entered.set(), gate.wait())))
            while not entered.is_set():
                await asyncio.sleep(0.001)
        started = asyncio.ensure_future(fork.start(source))
        if when == "while":
            while not s.runtime.engine.scheduler._calls:  # the capture is queued: the source closes under it
                await asyncio.sleep(0.001)
        elif when == "after":
            await started
        s.runtime.store.close(source)
        gate.set()
        if when == "while":
            await held
        await started
        await fork.built()
        if when == "before":
            assert fork.session_id is None
        if when == "after":
            assert fork.session_id is not None
        if fork.session_id is not None:
            assert await _digest(s, fork.session_id) == want  # its own copy, whole
        assert_accounted(s)
        assert len(s.runtime.store.sessions()) == (fork.session_id is not None)
