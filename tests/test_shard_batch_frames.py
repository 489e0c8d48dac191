"""One message per hop for many sessions (`Batch`, `ShardPipeline.forward_many`), on real workers
(tiny model, head [0, 1) + tail [1, 2), real grpc.aio servers on loopback).

Each entry is its session's own frame: the logits are bitwise those of the sessions' own
streams, a resent entry is a duplicate (not run again), an entry of an unknown session, a stale
epoch or the wrong frame kind is answered in its place while the others run, a fail-closed
entry also ends its session's stream, and a session failing inside a batch leaves the others.
"""

import asyncio
import contextlib

import numpy as np
import pytest

from inference_engine.errors import InvariantViolation, SessionNotFound
from inference_engine.shard.client.pipeline import ShardPipeline
from inference_engine.shard.protocol.errors import ShardErrorCode, ShardUnavailable
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.protocol.wire import work_frame
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.v1 import shard_runtime_pb2 as pb
from tests.fixtures.fault_config import FaultConfig
from tests.fixtures.fault_injection import FaultInjectingEngine
from tests.shard_helpers import shard_server

TOKENS = np.random.default_rng(11).integers(0, 256, 64).tolist()
SINK, WINDOW = 2, 6


@contextlib.asynccontextmanager
async def _route(tiny):
    """A connected pipeline over two real workers; yields it, the head's stub and the tail's fault switch."""
    head = MlxShardEngine(tiny.model, LayerRange(0, 1), block=8, max_rollback=8)
    tail = FaultInjectingEngine(MlxShardEngine(tiny.model, LayerRange(1, 2), block=8, max_rollback=8))
    async with contextlib.AsyncExitStack() as stack:
        served = [await stack.enter_async_context(shard_server(e)) for e in (head, tail)]
        pipeline = ShardPipeline([address for _, address, _ in served], step_timeout_s=10.0)
        await pipeline.connect()
        stack.push_async_callback(pipeline.close)
        yield pipeline, served[0][0], tail


async def _open(pipeline: ShardPipeline, *names: str) -> None:
    for name in names:
        await pipeline.open(name, SINK, WINDOW)


async def test_one_message_per_hop_gives_each_session_its_own_streams_bits(tiny):
    async with _route(tiny) as (p, _, _):
        await _open(p, "a", "b", "c", "ref-a", "ref-b", "ref-c")
        sent = []
        for b in p._batches:  # count what goes out: one request per hop, every session in it
            b.request = (lambda real: lambda entries: sent.append(len(entries)) or real(entries))(b.request)
        plan = [{"a": TOKENS[:5], "b": TOKENS[5:12], "c": TOKENS[12:13]},  # prefills of 5, 7 (past the window), 1
                {"a": TOKENS[20:21], "b": TOKENS[21:22], "c": TOKENS[22:25]},  # decodes and a 3-row block
                {"c": TOKENS[30:31], "a": TOKENS[31:32]}]
        for step in plan:
            got = await p.forward_many([(name, tokens, True) for name, tokens in step.items()])
            for (name, tokens), logits in zip(step.items(), got):
                want = await p.forward(f"ref-{name}", tokens)  # the same block on the session's own streams
                assert isinstance(logits, np.ndarray) and logits.tobytes() == want.tobytes()
        assert sent == [3, 3, 3, 3, 2, 2]
        for name in "abc":
            assert p.position(name) == p.position(f"ref-{name}")
            assert await p.layer_digests(name) == await p.layer_digests(f"ref-{name}")


async def test_refusals_stay_with_their_session(tiny):
    async with _route(tiny) as (p, _, _):
        await _open(p, "a", "b")
        got = await p.forward_many([("a", TOKENS[:3], False), ("nobody", TOKENS[:1], True), ("b", [10**6], True),
                                    ("b", TOKENS[:0], True)])
        assert isinstance(got[0], np.ndarray) and got[0].shape == (1, tiny.spec.vocab_size)
        assert isinstance(got[1], SessionNotFound) and "not open" in str(got[1])
        assert "out of range" in str(got[2]) and "1..65536 tokens" in str(got[3])
        assert p.position("a") == 3 and p.position("b") == 0  # b's refusals sent nothing
        got = await p.forward_many([("a", TOKENS[3:4], True), ("b", TOKENS[:2], True)])
        assert all(isinstance(x, np.ndarray) for x in got)
        with pytest.raises(Exception, match="at most once"):
            await p.forward_many([("a", TOKENS[4:5], True), ("a", TOKENS[5:6], True)])


async def test_a_session_failing_inside_a_batch_leaves_the_others(tiny):
    async with _route(tiny) as (p, _, _):
        await _open(p, "a", "b")
        await p.forward_many([("a", TOKENS[:4], False), ("b", TOKENS[4:8], False)])
        # a is released on the tail alone: the head runs a's entry, the tail cannot.
        await p._unary(1, "Release", pb.ShardReleaseRequest(route_session_id="a", route_epoch=p.epoch))
        got = await p.forward_many([("a", TOKENS[8:9], True), ("b", TOKENS[9:10], True)])
        assert isinstance(got[0], SessionNotFound) and "layers 1:2" in str(got[0])
        assert isinstance(got[1], np.ndarray) and p.position("b") == 5
        again = await p.forward_many([("a", TOKENS[10:11], True), ("b", TOKENS[10:11], True)])
        assert isinstance(again[0], InvariantViolation) and "replay its tokens" in str(again[0])
        assert isinstance(again[1], np.ndarray) and p.position("b") == 6 and p.position("a") == 4


async def test_the_batch_rpc_answers_each_entry_as_its_stream_would(tiny):
    async with _route(tiny) as (p, head_stub, _):
        await _open(p, "a", "b")
        ep = p.epoch

        def entry(name: str, step: int, position: int, token: int, epoch: int = ep) -> pb.ShardBatchEntry:
            return pb.ShardBatchEntry(route_session_id=name,
                                      frame=work_frame(name, epoch, step, position, [token], None, True))

        call = head_stub.Batch()
        first = [entry("a", 1, 0, TOKENS[0]), entry("b", 1, 0, TOKENS[1])]
        await call.write(pb.ShardBatchRequest(entries=first))
        answer = await call.read()
        assert [f.result.next_position for f in answer.frames] == [1, 1]
        assert all(f.flow.credits_granted == 1 for f in answer.frames)
        await call.write(pb.ShardBatchRequest(entries=[
            first[0],  # a resend: acknowledged as a duplicate, not run again
            entry("b", 2, 1, TOKENS[2], epoch=ep + 5),  # no session at that epoch here
            entry("ghost", 1, 0, TOKENS[3]),
            pb.ShardBatchEntry(route_session_id="a", frame=pb.ShardRequestFrame(trim=pb.ShardTrim(
                route_epoch=ep, idempotency_step=9, position=1, tokens=1))),
        ]))
        answer = await call.read()
        dup, later, ghost, trim = answer.frames
        assert dup.ack.duplicate and dup.ack.idempotency_step == 1
        assert later.error.code == ShardErrorCode.SESSION_NOT_FOUND and "epoch" in later.error.message
        assert ghost.error.code == ShardErrorCode.SESSION_NOT_FOUND
        assert trim.error.code == ShardErrorCode.INVALID_ARGUMENT and "chunk or decode" in trim.error.message
        # b at the wrong position: admitted, refused by the engine, which fails b closed
        await call.write(pb.ShardBatchRequest(entries=[entry("b", 2, 7, TOKENS[2])]))
        (wrong,) = (await call.read()).frames
        assert wrong.error.code == ShardErrorCode.FAILED_PRECONDITION and wrong.error.session_closed
        with pytest.raises(Exception, match="FAILED_PRECONDITION|position"):  # ... and ended b's own stream
            await p.forward("b", TOKENS[2:3])
        # a is untouched by all of it (the trim was refused, not run): its next step runs at position 1
        await call.write(pb.ShardBatchRequest(entries=[entry("a", 2, 1, TOKENS[4])]))
        (nxt,) = (await call.read()).frames
        assert (nxt.result.idempotency_step, nxt.result.position, nxt.result.next_position) == (2, 1, 2)
        # a stale epoch: after b is reopened at a newer one, an entry of the old one is refused
        p.advance_epoch()
        await _open(p, "b")
        await call.write(pb.ShardBatchRequest(entries=[entry("b", 1, 0, TOKENS[2], epoch=ep)]))
        (stale,) = (await call.read()).frames
        assert stale.error.code == ShardErrorCode.EPOCH_STALE and stale.error.message.startswith("a Batch entry for")
        assert isinstance(await p.forward("b", TOKENS[2:3]), np.ndarray)  # the new b is untouched
        call.cancel()


async def test_a_batch_stream_that_breaks_fails_its_sessions_and_the_next_batch_reopens_it(tiny):
    async with _route(tiny) as (p, _, tail):
        await _open(p, "a", "b", "ref-a", "ref-b")

        async def same_as_own_streams(got: list, blocks: dict[str, list[int]], ref: str = "ref-") -> None:
            """Each session's logits are bitwise those of the same tokens on a reference session's own stream."""
            for x, (name, tokens) in zip(got, blocks.items()):
                want = await p.forward(f"{ref}{name}", tokens)
                assert isinstance(x, np.ndarray) and x.tobytes() == want.tobytes(), name

        first = {"a": TOKENS[:2], "b": TOKENS[2:4]}
        await same_as_own_streams(await p.forward_many([(n, t, True) for n, t in first.items()]), first)
        p._batches[1]._call.cancel()  # ended between requests: the next request opens another stream
        second = {"a": TOKENS[4:5], "b": TOKENS[5:6]}
        await same_as_own_streams(await p.forward_many([(n, t, True) for n, t in second.items()]), second)
        assert (p.position("a"), p.position("b")) == (3, 3)
        p._batches[1].timeout_s = 0.1
        tail.inject(FaultConfig(delay_s=0.5))  # the tail's answer comes too late: the stream is dropped
        got = await p.forward_many([("a", TOKENS[6:7], True), ("b", TOKENS[7:8], True)])
        assert all(isinstance(x, Exception) and "did not answer a Batch request" in str(x) for x in got)
        tail.inject(FaultConfig())
        p._batches[1].timeout_s = 10.0
        p.advance_epoch()
        await _open(p, "a", "b", "ref2-a", "ref2-b")  # restored (as RouteBackend does, then replaying their logs)
        got = await p.forward_many([(n, t, True) for n, t in first.items()])
        await same_as_own_streams(got, first, ref="ref2-")  # from position 0 again, as fresh sessions
        assert (p.position("a"), p.position("b")) == (2, 2)


async def test_an_entry_whose_session_is_released_meanwhile_is_answered_not_lost(tiny):
    async with _route(tiny) as (p, _, tail):
        await _open(p, "a", "b", "ref-a", "ref-b")
        want = [(await p.forward(f"ref-{name}", tokens)).tobytes() for name, tokens in (("a", TOKENS[:1]),
                                                                                         ("b", TOKENS[1:2]))]
        tail.inject(FaultConfig(delay_s=0.3))  # each block sleeps on the tail's engine thread first
        batch = asyncio.create_task(p.forward_many([("a", TOKENS[:1], True), ("b", TOKENS[1:2], True)]))
        await asyncio.sleep(0.1)
        await p._unary(1, "Release", pb.ShardReleaseRequest(route_session_id="a", route_epoch=p.epoch))
        got = await asyncio.wait_for(batch, 60)  # answered, never left hanging (the guard only a hang)
        assert isinstance(got[1], np.ndarray) and got[1].tobytes() == want[1] and p.position("b") == 1
        if isinstance(got[0], np.ndarray):  # a's entry reached the tail's engine before the release: it ran
            assert got[0].tobytes() == want[0]
        else:  # released first: its entry is answered in its place
            assert isinstance(got[0], ShardUnavailable) and "session 'a' was released" in str(got[0]), got[0]


async def test_a_batch_cancelled_midway_fails_its_sessions(tiny):
    async with _route(tiny) as (p, _, tail):
        await _open(p, "a", "b", "c")
        tail.inject(FaultConfig(delay_s=0.3))
        batch = asyncio.create_task(p.forward_many([("a", TOKENS[:1], True), ("b", TOKENS[1:2], True)]))
        await asyncio.sleep(0.1)  # the head answered; the tail is computing
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        tail.inject(FaultConfig())
        for name in ("a", "b"):  # where they stand on the workers is unknown: they must be restored
            with pytest.raises(InvariantViolation, match="replay its tokens"):
                await p.forward(name, TOKENS[2:3])
        assert isinstance(await p.forward("c", TOKENS[2:3]), np.ndarray)  # not in the batch: untouched


async def test_an_empty_batch_gets_an_empty_answer(tiny):
    async with _route(tiny) as (_, stub, _):
        call = stub.Batch()
        await call.write(pb.ShardBatchRequest())
        assert len((await call.read()).frames) == 0
        call.cancel()
