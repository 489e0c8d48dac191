"""A new session's K/V is allocated off the engine thread (it stalled every running stream ~40 ms)."""

import threading

import mlx.core as mx
import numpy as np

from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.types import CreateSessionParams
from inference_engine.execution.token_log import TokenLog
from tests.conftest import make_config
from tests.coordinator_helpers import append_alone


def test_prepared_storage_is_the_sessions_own_zeroed_kv(tiny_engine):
    g = tiny_engine.geometry(2, 16)
    prepared = tiny_engine.backend.prepare(g)
    ex = tiny_engine.backend.open(g, TokenLog(), prepared)
    assert len(ex.cache) == len(prepared) == tiny_engine.spec.num_layers
    for cache, (keys, values) in zip(ex.cache, prepared):
        assert cache.keys is keys and cache.values is values and keys is not values
        assert keys.shape == (tiny_engine.spec.num_kv_heads, g.slots, tiny_engine.spec.head_dim)
        assert not np.any(np.array(keys)) and not np.any(np.array(values))
    unprepared = tiny_engine.backend.open(g, TokenLog())  # allocated in open, as before
    assert unprepared.cache[0].keys.shape == prepared[0][0].shape


async def test_create_session_prepares_off_the_engine_thread_and_computes_the_same(tiny_engine):
    threads: list[str] = []
    prepare = tiny_engine.prepare_session

    def recording(sink: int, window: int) -> object:
        threads.append(threading.current_thread().name)
        return prepare(sink, window)

    runtime = Runtime(tiny_engine, make_config())
    tiny_engine.prepare_session = recording
    try:
        sid = (await runtime.create_session(CreateSessionParams((), "t", 2, 16))).session_id
    finally:
        del tiny_engine.prepare_session
        await runtime.stop()
    assert threads and threads[0] != "mlx-engine" and threads[0] != threading.main_thread().name
    session = runtime.store.get(sid)
    tokens = [5, 17, 33, 2, 250, 9, 9, 120]
    append_alone(session.coordinator, tokens)  # a prepared slab computes what an unprepared one does
    other = tiny_engine.open_session(2, 16)
    append_alone(other, tokens)
    assert session.coordinator.state_digest() == other.state_digest()
    assert mx.array_equal(session.coordinator.verifier.next_token_logits, other.verifier.next_token_logits).item()


async def test_a_create_cancelled_while_its_kv_is_prepared_leaves_nothing(tiny_engine):
    import asyncio
    import time

    started = threading.Event()
    prepare = tiny_engine.prepare_session

    def slow(sink: int, window: int) -> object:
        started.set()
        time.sleep(0.2)
        return prepare(sink, window)

    runtime = Runtime(tiny_engine, make_config())
    tiny_engine.prepare_session = slow
    try:
        task = asyncio.ensure_future(runtime.create_session(CreateSessionParams((), "t", 2, 16)))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        done, _ = await asyncio.wait([task])
        assert task.cancelled()
        await asyncio.sleep(0.3)  # the worker thread finishes; its storage is dropped
        assert runtime.store.slabs_in_use == 0
        sid = (await runtime.create_session(CreateSessionParams((), "t", 2, 16))).session_id  # the pool is whole
        assert runtime.store.get(sid) is not None and runtime.store.slabs_in_use == 1
    finally:
        del tiny_engine.prepare_session
        await runtime.stop()


async def test_creates_racing_for_the_last_slab_allocate_once(tiny_engine):
    """The slab is held from the pool check on: a create that would not fit is refused before it allocates."""
    import asyncio
    import time

    from inference_engine.errors import PoolExhausted

    prepared: list[str] = []
    prepare = tiny_engine.prepare_session

    def slow(sink: int, window: int) -> object:
        prepared.append(threading.current_thread().name)
        time.sleep(0.1)  # every racer passes the pool check while the first one allocates
        return prepare(sink, window)

    runtime = Runtime(tiny_engine, make_config(max_sessions=2))
    tiny_engine.prepare_session = slow
    try:
        await runtime.create_session(CreateSessionParams((), "t", 2, 16))
        prepared.clear()
        results = await asyncio.gather(*(runtime.create_session(CreateSessionParams((), "t", 2, 16))
                                         for _ in range(4)), return_exceptions=True)
        made = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, PoolExhausted)]
        assert len(made) == 1 and len(refused) == 3, results
        assert len(prepared) == 1  # the refused ones never allocated
        assert runtime.store.slabs_in_use == 2
        runtime.store.get(made[0].session_id)  # registered
    finally:
        del tiny_engine.prepare_session
        await runtime.stop()
