"""ShardPipeline over real in-process workers on 127.0.0.1:0 (tiny model, head [0,1) + tail [1,2))."""

import asyncio
import contextlib

import mlx.core as mx
import numpy as np
import pytest

from inference_engine.errors import InvalidRequest, InvariantViolation, PoolExhausted, SessionNotFound
from inference_engine.shard.client.pipeline import ShardPipeline
from inference_engine.shard.protocol.errors import DeadlineExpired, EpochStale, MalformedShardOutput, ShardUnavailable
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.worker import mlx_engine
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.verifier.sink_window_verifier import state_digest
from tests.fixtures.fault_config import FaultConfig
from tests.fixtures.fault_injection import FaultInjectingEngine
from tests.shard_helpers import ref_block, reference, shard_server
from tests.tiny_models import random_model

TOKENS = np.random.default_rng(11).integers(0, 256, 80).tolist()
HEAD, TAIL = LayerRange(0, 1), LayerRange(1, 2)


def _engine(model, layers, faults=None, **kw):
    engine = MlxShardEngine(model, layers, block=4, max_rollback=4, **kw)
    return FaultInjectingEngine(engine, faults) if faults else engine


@contextlib.asynccontextmanager
async def _route(*engines):
    async with contextlib.AsyncExitStack() as stack:
        addresses = [(await stack.enter_async_context(shard_server(e)))[1] for e in engines]
        yield addresses


@contextlib.asynccontextmanager
async def _pipeline(tiny, tail_faults=None, **kw):
    async with _route(_engine(tiny.model, HEAD), _engine(tiny.model, TAIL, tail_faults)) as addresses:
        async with ShardPipeline(addresses, **kw) as pipeline:
            yield pipeline


async def test_pipeline_is_bitwise_the_single_process(tiny):
    async with _pipeline(tiny) as p:
        assert [c.layers for c in p.capabilities] == [HEAD, TAIL] and p.max_block == 4 and p.max_rollback == 4
        geometry = await p.open("s", sink=2, window=5)
        ref, position = reference(tiny, geometry), 0
        for n, all_logits in ((9, True), (1, True), (6, False), (1, False), (4, True), (12, True)):
            got = await p.forward("s", TOKENS[position : position + n], all_logits=all_logits)
            want = ref_block(ref, TOKENS[position : position + n], all_logits)
            assert got.shape == want.shape and got.tobytes() == want.tobytes()
            position += n
        draft = TOKENS[position : position + 4]
        got = await p.forward("s", draft)  # verify a 4-token draft, accept 1
        assert got.tobytes() == ref_block(ref, draft, keep=1).tobytes()
        assert await p.trim("s", 3) == position + 1 == p.position("s")
        got = await p.forward("s", [7, 8])
        assert got.tobytes() == ref_block(ref, [7, 8]).tobytes()
        digests = await p.layer_digests("s")
        assert digests == ref.executor.layer_digests()
        route_digest = state_digest(mx.array(got[-1]), ref.cached_token_sequence, p.position("s"), digests)
        assert route_digest == ref.state_digest()
        assert [h.sessions for h in await p.health()] == [1, 1]
        stats = p.hop_stats()
        assert [s.calls for s in stats] == [9, 9] and all(s.mean_ms > 0 for s in stats)
        assert await p.release("s") and not await p.release("s")
        assert [h.sessions for h in await p.health()] == [0, 0]


async def test_route_must_tile_the_model(tiny):
    other = random_model(seed=1)
    async with _route(_engine(tiny.model, HEAD), _engine(tiny.model, HEAD), _engine(other.model, TAIL)) as addrs:
        for route, match in (([addrs[0], addrs[1]], "needs layers starting at 1"),
                             ([addrs[0]], r"ends at layer 1; the model its workers run \(model, fingerprint "
                                          r"[0-9a-f]{12}\) has 2"),  # theirs, which may not be the server's
                             ([addrs[0], addrs[2]], "different model")):
            pipeline = ShardPipeline(route)
            with pytest.raises(InvalidRequest, match=match):
                await pipeline.connect()
            await pipeline.close()
    with pytest.raises(InvalidRequest):
        ShardPipeline([])


async def test_route_must_compute_with_one_kernel_setup(tiny, monkeypatch):
    """A worker on other BLAS kernels (say, without the row-gemv interposer) would break bit-exactness."""
    head = _engine(tiny.model, HEAD)
    head.load()
    monkeypatch.setattr(mlx_engine, "kernels_in_use", lambda: "MLX ops, BLAS openblas: /elsewhere/libopenblas.so")
    async with _route(head, _engine(tiny.model, TAIL)) as addrs:
        pipeline = ShardPipeline(addrs)
        with pytest.raises(InvalidRequest, match="one BLAS set-up"):
            await pipeline.connect()
        await pipeline.close()
    with pytest.raises(InvalidRequest):
        ShardPipeline(["127.0.0.1:1"], epoch=0)


async def test_unreachable_worker_is_unavailable():
    pipeline = ShardPipeline(["127.0.0.1:9"], connect_timeout_s=2.0)
    with pytest.raises(InvariantViolation, match="not connected"):
        await pipeline.open("s", 2, 5)
    with pytest.raises(InvariantViolation, match="not connected"):
        await pipeline.health()
    with pytest.raises(ShardUnavailable, match="127.0.0.1:9"):
        await pipeline.connect()
    await pipeline.close()


async def test_session_lifecycle_errors_and_epochs(tiny):
    async with _pipeline(tiny) as p:
        with pytest.raises(SessionNotFound):
            await p.forward("nope", [1])
        assert not await p.release("nope")
        await p.open("s", 2, 5)
        with pytest.raises(InvalidRequest, match="already open"):
            await p.open("s", 2, 5)
        with pytest.raises(InvalidRequest, match="1..65536"):
            await p.forward("s", [])
        with pytest.raises(InvalidRequest, match="token id 256"):
            await p.forward("s", [1, 256])
        await p.forward("s", TOKENS[:3])
        with pytest.raises(InvariantViolation, match="allowed 0..3"):
            await p.trim("s", 4)
        with pytest.raises(InvalidRequest, match="not newer"):
            p.advance_epoch(1)
        assert p.advance_epoch() == 2 and p.epoch == 2
        await p.open("s", 2, 5)  # supersedes epoch 1 on both workers
        assert p.position("s") == 0
        got = await p.forward("s", TOKENS[:3])
        assert got.tobytes() == ref_block(reference(tiny), TOKENS[:3]).tobytes()
        with pytest.raises(InvalidRequest, match="max_block"):
            await p.open("t", 2, 5, max_block=8)


async def test_a_newer_route_makes_the_older_one_stale(tiny):
    async with _route(_engine(tiny.model, HEAD), _engine(tiny.model, TAIL)) as addresses:
        async with ShardPipeline(addresses, epoch=1) as old, ShardPipeline(addresses, epoch=2) as new:
            await old.open("s", 2, 5)
            await new.open("s", 2, 5)
            with pytest.raises(EpochStale, match="superseded"):
                await old.forward("s", [1, 2])
            with pytest.raises(InvariantViolation, match="failed .*EpochStale"):
                await old.forward("s", [1, 2])
            with pytest.raises(EpochStale):
                await old.release("s")
            assert (await new.forward("s", [1, 2])).shape == (2, 256)


@pytest.mark.parametrize("kind", ["rows", "width", "nan", "position"])
async def test_malformed_output_is_caught(tiny, kind):
    async with _pipeline(tiny, tail_faults=FaultConfig(malformed=kind)) as p:
        await p.open("s", 2, 5)
        with pytest.raises(MalformedShardOutput, match=r"127\.0\.0\.1:\d+ \(layers 1:2\)"):
            await p.forward("s", TOKENS[:3])
        with pytest.raises(InvariantViolation, match="advance_epoch"):
            await p.forward("s", TOKENS[:3])
        with pytest.raises(InvariantViolation):
            await p.trim("s", 1)
        p.advance_epoch()
        await p.open("s", 2, 5)  # a failed session can be rebuilt at a newer epoch


async def test_worker_failures_surface_as_shard_errors(tiny):
    async with _pipeline(tiny, tail_faults=FaultConfig(crash_after=1)) as p:
        await p.open("s", 2, 5)
        await p.forward("s", TOKENS[:2])
        with pytest.raises(ShardUnavailable, match="crashed"):
            await p.forward("s", TOKENS[2:4])
    async with _pipeline(tiny, tail_faults=FaultConfig(memory_budget_bytes=1000)) as p:
        with pytest.raises(PoolExhausted, match="memory budget"):
            await p.open("s", 2, 5)
    async with _pipeline(tiny, tail_faults=FaultConfig(delay_s=0.5), step_timeout_s=0.1) as p:
        await p.open("s", 2, 5)
        with pytest.raises(DeadlineExpired, match="did not answer"):
            await p.forward("s", TOKENS[:2])


async def test_a_refused_open_frees_the_workers_that_accepted(tiny):
    head, tail = _engine(tiny.model, HEAD), _engine(tiny.model, TAIL, max_sessions=1)
    async with _route(head, tail) as addresses, ShardPipeline(addresses) as p:
        await p.open("a", 2, 5)
        with pytest.raises(PoolExhausted):
            await p.open("b", 2, 5)  # the head accepted "b", the tail is full
        assert [h.sessions for h in await p.health()] == [1, 1]
        assert await p.release("a")
        await p.open("b", 2, 5)  # the same epoch works again at once
        assert (await p.forward("b", [1, 2])).shape == (2, 256)


async def test_cancel_fails_the_session_on_every_worker(tiny):
    async with _pipeline(tiny) as p:
        await p.open("s", 2, 5)
        await p.forward("s", TOKENS[:2])
        await p.cancel("s")
        with pytest.raises(InvariantViolation, match="cancelled"):
            await p.forward("s", TOKENS[2:3])
        for _ in range(250):
            if [h.sessions for h in await p.health()] == [0, 0]:
                break
            await asyncio.sleep(0.02)
        assert [h.sessions for h in await p.health()] == [0, 0]
