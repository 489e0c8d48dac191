"""RouteBackend over real in-process shard workers (tiny model, head [0,1) + tail [1,2)):
a verifier on the route is bitwise a local one, a worker that dies and comes back is
invisible to the caller (replay from the session's log), one that stays dead is
UNAVAILABLE, several sessions' blocks go out together, and closing frees the workers' slots."""

import asyncio
import contextlib
import time

import grpc
import numpy as np
import pytest

from inference_engine.runtime.engine import Engine
from inference_engine.server.server import connect_shards
from inference_engine.shard.client.route import ShardRoute
from inference_engine.shard.client.route_backend import RemoteExecutor, RouteBackend
from inference_engine.shard.protocol.errors import ShardUnavailable
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier
from tests.conftest import make_config, running_server
from tests.fixtures.fault_config import FaultConfig
from tests.fixtures.fault_injection import FaultInjectingEngine
from tests.shard_helpers import shard_server

TOKENS = np.random.default_rng(3).integers(0, 256, 60).tolist()
SINK, WINDOW = 2, 6


@contextlib.asynccontextmanager
async def _served(tiny, recovery_s: float = 5.0):
    """An engine whose target runs on a 2-worker route; yields it, the tail's fault switch and both engines."""
    head = MlxShardEngine(tiny.model, LayerRange(0, 1), block=8, max_rollback=9)
    tail = FaultInjectingEngine(MlxShardEngine(tiny.model, LayerRange(1, 2), block=8, max_rollback=9))
    engine = Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8)
    async with contextlib.AsyncExitStack() as stack:
        addresses = [(await stack.enter_async_context(shard_server(e)))[1] for e in (head, tail)]
        route = ShardRoute(addresses, recovery_s, retry_interval_s=0.05)
        await route.start()
        engine.use_backend(RouteBackend(route, tiny.spec, engine.block))
        try:
            yield engine, tail, (head, tail)
        finally:
            engine.close()
            await route.stop()


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
    async with _served(tiny) as (engine, _, _):
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
    async with _served(tiny) as (engine, tail, _):
        local = Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8)
        want = _script(local.make_verifier(SINK, WINDOW))
        local.close()
        loop = asyncio.get_running_loop()

        def crash(i: int) -> None:
            # The tail dies at step 2's forward and at step 6's trim (after its forward); back 0.2 s later.
            if i in (2, 6):
                tail.inject(FaultConfig(crash_after=1 if i == 2 else 2), calls=1)
                loop.call_soon_threadsafe(loop.call_later, 0.2, tail.inject, FaultConfig())

        v = await engine.run(engine.make_verifier, SINK, WINDOW)
        assert await engine.run(_script, v, crash) == want


async def test_worker_that_stays_dead_is_unavailable_then_recovers(tiny):
    async with _served(tiny, recovery_s=0.3) as (engine, tail, _):
        v = await engine.run(engine.make_verifier, SINK, WINDOW)
        await engine.run(v.prefill, TOKENS[:9])
        tail.inject(FaultConfig(crash_after=1), calls=1)
        with pytest.raises(ShardUnavailable, match="is not answering .* retry shortly"):
            await engine.run(v.forward_block, TOKENS[9:12])
        with pytest.raises(ShardUnavailable):
            await engine.run(engine.make_verifier, SINK, WINDOW)
        tail.inject(FaultConfig())
        logits = await engine.run(v.forward_block, TOKENS[9:12])
        assert logits.shape == (3, tiny.spec.vocab_size) and v.executor.offset == 12


async def test_blocks_of_several_sessions_go_out_together_and_close_frees_the_slots(tiny):
    async with _served(tiny) as (engine, _, workers):
        local = Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8)
        try:
            want = [local.make_verifier(SINK, WINDOW) for _ in range(3)]
            for i, v in enumerate(want):
                v.prefill(TOKENS[i : i + 9])
            got = [await engine.run(engine.make_verifier, SINK, WINDOW) for _ in range(3)]
            assert all(w.metrics().sessions == 3 for w in workers)

            def together() -> None:
                blocks = [v.begin_block(TOKENS[i : i + 9], all_logits=False) for i, v in enumerate(got)]
                for v, out in zip(got, engine.backend.forward(blocks)):
                    v.end_block(out)
                    v.commit_or_truncate(9, 9)

            sent = []
            for b in engine.backend.route.pipeline._batches:
                b.request = (lambda real: lambda entries: sent.append(len(entries)) or real(entries))(b.request)
            await engine.run(together)
            assert sent == [3, 3]  # one Batch message per hop carried all three sessions
            assert [await engine.run(v.state_digest) for v in got] == [v.state_digest() for v in want]
            for v in got:
                v.executor.close()
                v.executor.close()  # idempotent
            for _ in range(100):  # the release goes out in the background
                if all(w.metrics().sessions == 0 for w in workers):
                    break
                await asyncio.sleep(0.02)
            assert [w.metrics().sessions for w in workers] == [0, 0]
        finally:
            local.close()


async def test_a_worker_dying_under_batched_blocks_is_invisible_to_every_session(tiny):
    """Three sessions' blocks go through the route together (one Batch message per hop); the tail dies
    inside one of those forwards and comes back: every session is restored from its log and ends
    bitwise where a single process ends."""
    plan = [(9, 9), (1, 1), (4, 2), (1, 1), (3, 3), (2, 0), (1, 1)]  # (rows, accepted) per step
    async with _served(tiny) as (engine, tail, _):
        local = Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8)
        loop = asyncio.get_running_loop()

        def run(e: Engine, vs: list, before_step=lambda i: None, together: bool = True) -> list[list[str]]:
            positions, digests = [0] * len(vs), []
            for i, (n, keep) in enumerate(plan):
                before_step(i)
                blocks = [v.begin_block(TOKENS[k + positions[k] : k + positions[k] + n]) for k, v in enumerate(vs)]
                outs = e.backend.forward(blocks) if together else [e.backend.forward([b])[0] for b in blocks]
                for k, (v, out) in enumerate(zip(vs, outs)):
                    v.end_block(out)
                    v.commit_or_truncate(n, keep)
                    positions[k] += keep
                digests.append([v.state_digest() for v in vs])
            return digests

        try:
            want = run(local, [local.make_verifier(SINK, WINDOW) for _ in range(3)], together=False)
        finally:
            local.close()

        def crash(i: int) -> None:
            if i in (2, 5):  # the tail dies inside this step's batched forward; back 0.2 s later
                tail.inject(FaultConfig(crash_after=1), calls=0)
                loop.call_soon_threadsafe(loop.call_later, 0.2, tail.inject, FaultConfig())

        got = [await engine.run(engine.make_verifier, SINK, WINDOW) for _ in range(3)]
        assert await engine.run(run, engine, got, crash) == want


async def _sessions_on(workers, want: int) -> list[int]:
    deadline = time.monotonic() + 60  # a hang guard: releases go out in the background
    while not all(w.metrics().sessions == want for w in workers) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return [w.metrics().sessions for w in workers]


async def test_close_session_and_expiry_free_the_workers_slots(tiny):
    async with _served(tiny) as (engine, _, workers), running_server(engine, session_ttl_s=1.0) as (stub, _):
        sids = [(await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
                for _ in range(2)]
        for sid in sids:
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=TOKENS[:9]))
        assert await _sessions_on(workers, 2) == [2, 2]
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sids[0]))
        assert await _sessions_on(workers, 1) == [1, 1]
        assert await _sessions_on(workers, 0) == [0, 0]  # the other one expires (the sweeper runs every ttl/4)


@contextlib.asynccontextmanager
async def _connected(tiny, **config):
    """As `_served`, the route built by the server's own `connect_shards` from a ServerConfig with `config`."""
    head = MlxShardEngine(tiny.model, LayerRange(0, 1), block=8, max_rollback=9)
    tail = FaultInjectingEngine(MlxShardEngine(tiny.model, LayerRange(1, 2), block=8, max_rollback=9))
    engine = Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8)
    async with contextlib.AsyncExitStack() as stack:
        served = [await stack.enter_async_context(shard_server(e)) for e in (head, tail)]
        addresses = tuple(address for _, address, _ in served)
        tail.worker_thread = served[1][2].thread  # the tail's engine thread (a test waits for it to be idle)
        route, _ = await connect_shards(make_config(shards=addresses, **config), engine)
        try:
            yield engine, tail
        finally:
            route.is_closed = True
            engine.close()
            await route.stop()


async def _reference(tiny, n: int) -> tuple[list[int], str]:
    """One process: `n` greedy tokens after TOKENS[:9], and the session's digest after them."""
    local = Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8)
    try:
        async with running_server(local) as (stub, _):
            sid = await _session(stub)
            tokens = await _generate(stub, sid, n)
            return tokens, (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest
    finally:
        local.close()


async def _session(stub) -> str:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=TOKENS[:9]))
    return sid


async def _generate(stub, sid: str, n: int, got: list[int] | None = None, after=None) -> list[int]:
    """`n` greedy tokens into `got`; `after(len(got))` runs after each message."""
    got = [] if got is None else got
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True)):
        got += msg.tokens
        if after is not None:
            after(len(got))
    return got


async def test_a_generate_on_a_dead_route_fails_unavailable_and_keeps_what_it_sent(tiny):
    """The tail dies mid-stream and stays dead: the stream fails UNAVAILABLE after the recovery timeout
    (not OK with stop reason CANCELLED, which means closed or shutting down), a Generate started then
    too; the sent tokens stay in the history and, the tail back, the session continues exactly."""
    want, digest = await _reference(tiny, 24)
    async with _connected(tiny, shard_recovery_timeout_s=1.0) as (engine, tail), running_server(engine) as (stub, _):
        sid = await _session(stub)
        got: list[int] = []
        died: list[bool] = []

        def kill(sent: int) -> None:
            if sent >= 5 and not died:
                tail.inject(FaultConfig(crash_after=1), calls=1)
                died.append(True)

        with pytest.raises(grpc.aio.AioRpcError) as err:  # the recovery timeout ends it (the guard only a hang)
            await asyncio.wait_for(_generate(stub, sid, 24, got, kill), 60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "the session is kept" in err.value.details() and "retry shortly" in err.value.details()
        assert "crashed after 1 calls" in err.value.details()  # restoring met the dead tail until it gave up
        assert 5 <= len(got) < 24 and got == want[: len(got)]
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # still down: no token, UNAVAILABLE
            await asyncio.wait_for(_generate(stub, sid, 4), 60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "crashed after 1 calls" in err.value.details()
        assert time.monotonic() - started >= 1.0  # it waited out the recovery timeout (a bound no load can break)
        tail.inject(FaultConfig())
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert info.history_length == 9 + len(got)  # what the client saw, nothing more
        got += await _generate(stub, sid, 24 - len(got))
        assert got == want
        assert (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest == digest


async def test_a_hung_worker_is_given_up_on_at_the_configured_deadlines(tiny):
    """The tail stops answering mid-stream (each step sleeps HANG_S): the step deadline
    (--shard-step-timeout) fails it, and the call ends UNAVAILABLE once the route has been silent
    for the recovery timeout since the step went out, not after the former fixed 120 s (or once the
    sleeping step answers); the session then continues exactly."""
    hang_s = 6.0
    want, digest = await _reference(tiny, 24)
    async with _connected(tiny, shard_recovery_timeout_s=3.0, shard_step_timeout_s=1.0) as (engine, tail), \
            running_server(engine) as (stub, _):
        assert engine.backend.route.pipeline.step_timeout_s == 1.0  # from the ServerConfig
        sid = await _session(stub)
        got: list[int] = []

        def hang(sent: int) -> None:
            if sent >= 5 and not tail.faults.delay_s:
                tail.inject(FaultConfig(delay_s=hang_s))

        with pytest.raises(grpc.aio.AioRpcError) as err:  # a step that answered late would end the stream OK
            await asyncio.wait_for(_generate(stub, sid, 24, got, hang), 60)
        details = err.value.details()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "the session is kept" in details
        assert "within the recovery timeout (3 s)" in details, details  # the deadline that ended the call
        assert got == want[: len(got)] and 5 <= len(got) < 24
        tail.inject(FaultConfig())
        for _ in range(2):  # the sleeping steps end (a call queued behind them), the last ones sent too
            await asyncio.wait_for(tail.worker_thread.run(lambda: None), 120)
            await asyncio.sleep(0.5)
        got += await _generate(stub, sid, 24 - len(got))
        assert got == want
        assert (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest == digest


async def test_a_retry_while_a_hung_worker_is_still_busy_is_unavailable_then_continues_exactly(tiny):
    """Issue 33: a call cut off while restoring sent a SessionOpen the hung tail frees only behind its
    sleeping steps. A client retry at once must not reopen at that same route epoch (the tail answered
    INVALID_ARGUMENT "already open at route epoch 2"): it gets UNAVAILABLE, and once the tail is back
    the retries continue the stream exactly."""
    want, digest = await _reference(tiny, 24)
    async with _connected(tiny, shard_recovery_timeout_s=2.0, shard_step_timeout_s=0.5) as (engine, tail), \
            running_server(engine) as (stub, _):
        sid = await _session(stub)
        got: list[int] = []

        def hang(sent: int) -> None:
            if sent >= 5 and not tail.faults.delay_s:
                tail.inject(FaultConfig(delay_s=6.0))

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(_generate(stub, sid, 24, got, hang), 60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "restoring the session got no answer" in err.value.details()  # a SessionOpen went out and hung
        codes = []
        while len(got) < 24 and len(codes) < 60:  # "retry shortly": at once, the tail still sleeping at first
            try:
                await asyncio.wait_for(_generate(stub, sid, 24 - len(got), got), 60)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, (codes, exc.details())
            tail.inject(FaultConfig())  # back after the first retry (the steps already sleeping run out)
        assert codes[0] == grpc.StatusCode.UNAVAILABLE and codes[-1] == grpc.StatusCode.OK, codes
        assert got == want
        assert (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest == digest


async def test_a_session_closed_while_its_route_is_silent_ends_its_stream_cancelled(tiny):
    """CANCELLED keeps its meaning: the session was closed (here, while the step waited for a dead route)."""
    async with _connected(tiny, shard_recovery_timeout_s=1.0) as (engine, tail), \
            running_server(engine) as (stub, runtime):
        sid = await _session(stub)
        tail.inject(FaultConfig(crash_after=1), calls=1)
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=8, ignore_eos=True))
        for _ in range(100):  # the stream started: its first step waits for the route
            if runtime._streams:
                break
            await asyncio.sleep(0.01)
        closed = await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        messages = [m async for m in stream]
        assert [t for m in messages for t in m.tokens] == [] and closed.history_length == 9
        assert messages[-1].stop_reason == pb.STOP_REASON_CANCELLED


async def test_a_route_failure_is_unavailable_but_shutdown_ends_a_stream_cancelled(tiny):
    """The stop reason CANCELLED is kept for its meaning: the server shutting down (the engine closing)."""
    async with _connected(tiny) as (engine, _), running_server(engine) as (stub, _):
        sid = await _session(stub)
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=1000, ignore_eos=True))
        await stream.read()
        await asyncio.to_thread(engine.scheduler.close)  # what shutdown does once the streams had their grace
        last = msg = await stream.read()
        while msg is not grpc.aio.EOF:
            last, msg = msg, await stream.read()
        assert last.stop_reason == pb.STOP_REASON_CANCELLED and await stream.code() == grpc.StatusCode.OK
