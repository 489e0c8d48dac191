"""Canonical K/V out of a session and into a new one (tiny model): local caches, coordinators and
a 2-worker route. A session loaded from another's canonical state has its digest and continues
with its bits, after a window wrap and a rollback; a state that does not fit fails and frees all."""

import contextlib

import mlx.core as mx
import numpy as np
import pytest

from inference_engine.errors import InvalidRequest, InvariantViolation
from inference_engine.runtime.engine import Engine
from inference_engine.session.coordinator import SessionCoordinator
from inference_engine.shard.client.route import ShardRoute
from inference_engine.shard.client.route_backend import RouteBackend
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.execution.kv_cache import CacheGeometry, CanonicalKV, SinkWindowKVCache
from tests.coordinator_helpers import append_alone, verify_alone
from tests.kernel_guard import assert_full_tile
from tests.shard_helpers import shard_server

TOKENS = np.random.default_rng(5).integers(0, 256, 80).tolist()
SINK, WINDOW = 2, 6
G = CacheGeometry(sink=2, window=4, max_block=3, max_rollback=2)


@pytest.fixture(scope="module")
def engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8))
    yield e
    e.close()


def _fill(c: SinkWindowKVCache, n: int) -> None:
    for p in range(n):
        kv = mx.full((1, 1, 2), float(p + 1))
        c.update_and_fetch(kv, kv)


def test_cache_load_canonical_round_trip():
    src = SinkWindowKVCache(G, num_kv_heads=1, head_dim=2)
    _fill(src, 13)
    src.trim(2)  # a rollback after the wrap: stale rows stay in the ring, outside the canonical state
    k, v = (np.array(a) for a in src.canonical_state())
    dst = SinkWindowKVCache(G, num_kv_heads=1, head_dim=2)
    dst.load_canonical(11, k, v)
    assert dst.offset == 11 and dst.digest() == src.digest()
    assert dst.retained_positions() == [0, 1, 7, 8, 9, 10]
    empty = SinkWindowKVCache(G, num_kv_heads=1, head_dim=2)
    empty.load_canonical(0, k[:, :0], v[:, :0])
    assert empty.offset == 0
    with pytest.raises(ValueError, match="fresh cache only"):
        dst.load_canonical(11, k, v)
    for bad_k, bad_v, offset in ((k, v, 3), (k.astype(np.float16), v, 11), (k, v[:, :-1], 11)):
        with pytest.raises(ValueError, match="do not fit a cache at position"):
            SinkWindowKVCache(G, num_kv_heads=1, head_dim=2).load_canonical(offset, bad_k, bad_v)


def _script(coord: SessionCoordinator) -> None:
    """Prefill, appends past the window, a verified block with a partial accept, a retract."""
    append_alone(coord, TOKENS[:9])
    append_alone(coord, TOKENS[9:20])
    block = TOKENS[20:25]
    verify_alone(coord, block)
    coord.accept(block, 2)
    coord.retract(1, None)  # logits unknown: the next step recomputes them
    append_alone(coord, TOKENS[25:27])


def _continue(coord: SessionCoordinator) -> tuple[bytes, str]:
    """More work after the restore point; returns the verify logits and the final digest."""
    append_alone(coord, TOKENS[30:37])
    logits = np.array(verify_alone(coord, TOKENS[37:41]))
    coord.accept(TOKENS[37:41], 3)
    return logits.tobytes(), coord.state_digest()


def _local_round_trip(engine: Engine) -> None:
    src = engine.open_session(SINK, WINDOW)
    _script(src)
    tokens, logits, kv = src.export_state()
    assert kv.position == len(tokens) == 23 and kv.keys.shape == (2, 2, SINK + WINDOW, 16)
    assert kv.layer_digests() == src.verifier.executor.layer_digests()
    dst = SessionCoordinator.from_state(engine.backend, src.geometry, tokens, logits, kv)
    assert dst.state_digest() == src.state_digest() and list(dst.log) == list(src.log)
    assert _continue(dst) == _continue(src)
    src.close()
    dst.close()


async def test_local_state_round_trip_continues_bitwise(engine):
    await engine.run(_local_round_trip, engine)


def _refusals(engine: Engine) -> None:
    src = engine.open_session(SINK, WINDOW)
    append_alone(src, TOKENS[:12])
    tokens, logits, kv = src.export_state()
    g = src.geometry
    with pytest.raises(InvariantViolation, match="fresh cache"):
        src.verifier.executor.load_canonical_kv(kv)
    opened: list[SessionCoordinator] = []
    original_init = SessionCoordinator.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        opened.append(self)

    SessionCoordinator.__init__ = tracking_init
    try:
        cases = [
            (tokens[:-1], logits, kv, "K/V at position 12"),
            (tokens, None, kv, "no logits"),
            (tokens, logits, CanonicalKV(12, kv.keys[:1], kv.values[:1]), "1 layers"),
            (tokens, logits, CanonicalKV(12, kv.keys[:, :, :-1], kv.values[:, :, :-1]), "do not fit"),
        ]
        for toks, lg, state, message in cases:
            with pytest.raises(InvariantViolation, match=message):
                SessionCoordinator.from_state(engine.backend, g, toks, lg, state)
    finally:
        SessionCoordinator.__init__ = original_init
    assert len(opened) == 4 and all(c.verifier.executor.cache == [] for c in opened)  # every slab freed
    loaded = SessionCoordinator.from_state(engine.backend, g, [], None, CanonicalKV(0, kv.keys[:, :, :0],
                                                                                     kv.values[:, :, :0]))
    fresh = engine.open_session(SINK, WINDOW)
    assert loaded.position == 0 and loaded.state_digest() == fresh.state_digest()
    for c in (loaded, fresh, src):
        c.close()


async def test_states_that_do_not_fit_are_refused_and_free_everything(engine):
    await engine.run(_refusals, engine)


@contextlib.asynccontextmanager
async def _route_engine(tiny):
    head = MlxShardEngine(tiny.model, LayerRange(0, 1), block=8, max_rollback=9)
    tail = MlxShardEngine(tiny.model, LayerRange(1, 2), block=8, max_rollback=9)
    engine = assert_full_tile(Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8))
    async with contextlib.AsyncExitStack() as stack:
        addresses = [(await stack.enter_async_context(shard_server(e)))[1] for e in (head, tail)]
        route = ShardRoute(addresses, 5.0, retry_interval_s=0.05)
        await route.start()
        engine.use_backend(RouteBackend(route, tiny.spec, engine.block))
        try:
            yield engine, (head, tail)
        finally:
            engine.close()
            await route.stop()


async def test_route_exports_and_imports_the_single_process_state(tiny, engine):
    local = await engine.run(engine.open_session, SINK, WINDOW)
    await engine.run(_script, local)
    want_tokens, want_logits, want_kv = await engine.run(local.export_state)
    async with _route_engine(tiny) as (routed, workers):
        remote = await routed.run(routed.open_session, SINK, WINDOW)
        await routed.run(_script, remote)
        tokens, logits, kv = await routed.run(remote.export_state)
        assert tokens == want_tokens and logits.tobytes() == want_logits.tobytes()
        assert kv.keys.tobytes() == want_kv.keys.tobytes() and kv.values.tobytes() == want_kv.values.tobytes()
        # The local state onto the route, and on: the same bits as the local session continuing.
        onto = await routed.run(SessionCoordinator.from_state, routed.backend, remote.geometry, want_tokens,
                                want_logits, want_kv)
        assert await routed.run(onto.state_digest) == await engine.run(local.state_digest)
        assert await routed.run(_continue, onto) == await engine.run(_continue, local)
        assert all(w.metrics().sessions == 2 for w in workers)
        with pytest.raises(InvariantViolation, match="does not fit this model"):
            await routed.run(SessionCoordinator.from_state, routed.backend, remote.geometry, want_tokens,
                             want_logits, CanonicalKV(23, kv.keys[:, :, :-1], kv.values[:, :, :-1]))
        with pytest.raises(InvariantViolation, match="fresh executor"):
            await routed.run(onto.verifier.executor.load_canonical_kv, kv)
        p, sid = routed.backend.route.pipeline, onto.verifier.executor.session_id
        with pytest.raises(InvalidRequest, match="K/V of 1 blocks"):
            routed.backend.route.call(lambda: p.import_kv(sid, 23, [(kv.keys[0], kv.values[0])]))
        layers = list(zip(kv.keys, kv.values))
        with pytest.raises(InvariantViolation, match="just opened"):
            routed.backend.route.call(lambda: p.import_kv(sid, 23, layers))
        await engine.run(local.close)
