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


async def _slab(engine) -> int:
    async with http_api(engine) as s:
        return s.runtime.store.get(await _prefilled(s)).kv_bytes


@pytest.mark.parametrize("when", ["sealing", "installing"])
async def test_a_fork_cancelled_while_it_runs_leaves_nothing_behind(tiny_engine, when):
    async with http_api(tiny_engine, **_limits(await _slab(tiny_engine))) as s:
        source = await _prefilled(s)
        fork = _fork(s)
        await fork.start(source)  # the state is copied: the task goes on sealing it
        entered, gate = threading.Event(), threading.Event()
        if when == "installing":  # the engine thread held: the fork's install call waits in its queue
            held = asyncio.ensure_future(s.runtime.engine.run(lambda: (entered.set(), gate.wait())))
            while not (entered.is_set() and s.runtime.engine.scheduler._calls):
                await asyncio.sleep(0.001)
        fork._task.cancel()
        gate.set()  # the install runs (a cancelled call still completes): the slab it built is freed
        await fork.built()
        if when == "installing":
            await held
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
        started = asyncio.ensure_future(fork.start(source))
        if when == "while":
            await asyncio.sleep(0)  # the fork has asked the engine thread for the copy
        elif when == "after":
            await started
        s.runtime.store.close(source)
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
