"""RemoteExecutor over real in-process shard workers (tiny model, head [0,1) + tail [1,2)):
a verifier on the route is bitwise a local one, and a worker that dies and comes back is
invisible to the caller (replay), while one that stays dead is UNAVAILABLE."""

import asyncio
import contextlib

import numpy as np
import pytest

from inference_engine.runtime.engine import Engine
from inference_engine.shard.errors import ShardUnavailable
from inference_engine.shard.fault_config import FaultConfig
from inference_engine.shard.fault_injection import FaultInjectingEngine
from inference_engine.shard.mlx_engine import MlxShardEngine
from inference_engine.shard.pipeline import ShardPipeline
from inference_engine.shard.remote_executor import RemoteExecutor, ShardRoute
from inference_engine.shard.types import LayerRange
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier
from tests.shard_helpers import shard_server

TOKENS = np.random.default_rng(3).integers(0, 256, 60).tolist()
SINK, WINDOW = 2, 6


@contextlib.asynccontextmanager
async def _served(tiny, recovery_s: float = 5.0):
    """An engine whose target runs on a 2-worker route; yields it and the tail's fault switch."""
    head = MlxShardEngine(tiny.model, LayerRange(0, 1), block=8, max_rollback=9)
    tail = FaultInjectingEngine(MlxShardEngine(tiny.model, LayerRange(1, 2), block=8, max_rollback=9))
    engine = Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8)
    async with contextlib.AsyncExitStack() as stack:
        addresses = [(await stack.enter_async_context(shard_server(e)))[1] for e in (head, tail)]
        pipeline = await stack.enter_async_context(ShardPipeline(addresses))
        engine.use_route(ShardRoute(pipeline, asyncio.get_running_loop(), recovery_s, retry_interval_s=0.05))
        try:
            yield engine, tail
        finally:
            engine.close()


def _script(v: SinkWindowVerifier, before_step=lambda i: None) -> list[str]:
    """Prefill, appends, verified drafts with partial accepts, a rollback; digest after each step."""
    v.prefill(TOKENS[:9])
    digests, position = [v.state_digest()], 9
    for i, (n, keep) in enumerate([(1, 1), (4, 2), (3, 3), (5, 1), (1, 1), (6, 6), (2, 0), (4, 3)]):
        before_step(i)
        v.forward_block(TOKENS[position : position + n])
        v.commit_or_truncate(n, keep)
        position += keep
        digests.append(v.state_digest())
    v.rollback(2)
    digests.append(v.state_digest())
    return digests


async def test_route_verifier_is_bitwise_the_local_one(tiny):
    async with _served(tiny) as (engine, _):
        local = Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8)
        try:
            want = _script(local.make_verifier(SINK, WINDOW))
            v = await engine.run(engine.make_verifier, SINK, WINDOW)
            assert isinstance(v.executor, RemoteExecutor)
            assert await engine.run(_script, v) == want
            assert v.nbytes == local.make_verifier(SINK, WINDOW).nbytes
        finally:
            local.close()


async def test_worker_death_mid_script_is_invisible(tiny):
    async with _served(tiny) as (engine, tail):
        local = Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8)
        want = _script(local.make_verifier(SINK, WINDOW))
        local.close()
        loop = asyncio.get_running_loop()

        def crash(i: int) -> None:
            # The tail dies at step 2's forward and at step 6's trim (after its forward); back 0.2 s later.
            if i in (2, 6):
                tail.faults, tail._calls = FaultConfig(crash_after=1 if i == 2 else 2), 1
                loop.call_soon_threadsafe(loop.call_later, 0.2, setattr, tail, "faults", FaultConfig())

        v = await engine.run(engine.make_verifier, SINK, WINDOW)
        assert await engine.run(_script, v, crash) == want


async def test_worker_that_stays_dead_is_unavailable_then_recovers(tiny):
    async with _served(tiny, recovery_s=0.3) as (engine, tail):
        v = await engine.run(engine.make_verifier, SINK, WINDOW)
        await engine.run(v.prefill, TOKENS[:9])
        tail.faults, tail._calls = FaultConfig(crash_after=1), 1
        with pytest.raises(ShardUnavailable, match="is not answering .* retry shortly"):
            await engine.run(v.forward_block, TOKENS[9:12])
        with pytest.raises(ShardUnavailable):
            await engine.run(engine.make_verifier, SINK, WINDOW)
        tail.faults = FaultConfig()
        logits = await engine.run(v.forward_block, TOKENS[9:12])
        assert logits.shape == (3, tiny.spec.vocab_size) and v.executor.offset == 12
