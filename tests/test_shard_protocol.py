"""ShardRuntime over a real grpc.aio server on 127.0.0.1:0: every fail-closed path (tiny model)."""

import asyncio
import time

import grpc
import numpy as np
import pytest

from inference_engine.shard.protocol.tensor_codec import decode_tensor, encode_tensor
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.worker import session_stream
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.execution.kv_cache import CacheGeometry
from tests.fixtures.fault_config import FaultConfig
from tests.fixtures.fault_injection import FaultInjectingEngine
from tests.shard_helpers import chunk_msg, fails_closed, open_msg, opened, ref_block, reference, shard_server

E = pb  # error codes read as E.SHARD_ERROR_...
TOKENS = [5, 17, 33, 2, 250, 9, 9, 120, 64, 3, 77, 1]


def _engine(tiny, layers=LayerRange(0, 2), **kw) -> MlxShardEngine:
    return MlxShardEngine(tiny.model, layers, block=4, max_rollback=4, **kw)


def _faulty(tiny, layers=LayerRange(0, 2), **faults) -> MlxShardEngine:
    return FaultInjectingEngine(_engine(tiny, layers), FaultConfig(**faults))


def _past() -> int:
    return time.time_ns() - 1_000_000


async def _health(stub):
    return await stub.Health(pb.ShardHealthRequest())


async def _until(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.02)


async def test_capability_health_and_a_session_round_trip(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        cap = await stub.GetCapability(pb.ShardCapabilityRequest())
        assert (cap.layer_start, cap.layer_end, cap.num_layers, cap.vocab_size, cap.hidden_size) == (0, 2, 2, 256, 64)
        assert cap.max_block == 4 and cap.max_credits == 8 and cap.activation_dtype == pb.TENSOR_DTYPE_FLOAT32
        call = stub.Session()
        await call.write(open_msg(credits=3))
        accepted = (await call.read()).accepted
        assert (accepted.route_session_id, accepted.route_epoch, accepted.credits) == ("s", 1, 3)
        ref = reference(tiny)
        await call.write(chunk_msg(1, 0, TOKENS[:10]))
        r = await call.read()
        assert (r.result.idempotency_step, r.result.position, r.result.next_position) == (1, 0, 10)
        assert r.flow.credits_granted == 1 and r.flow.credits_available == 3
        assert decode_tensor(r.result.output).tobytes() == ref_block(ref, TOKENS[:10]).tobytes()
        await call.write(pb.ShardRequestFrame(decode=pb.DecodeStep(route_epoch=1, idempotency_step=2, position=10,
                                                                   token_id=42)))
        r = await call.read()
        assert decode_tensor(r.result.output).tobytes() == ref_block(ref, [42]).tobytes()
        await call.write(pb.ShardRequestFrame(trim=pb.ShardTrim(route_epoch=1, idempotency_step=3, position=11,
                                                                tokens=2)))
        r = await call.read()
        assert (r.result.position, r.result.next_position, r.result.HasField("output")) == (11, 9, False)
        await call.write(pb.ShardRequestFrame(digest=pb.ShardDigest(route_epoch=1, idempotency_step=4, position=9)))
        r = await call.read()
        assert (r.result.next_position, len(r.result.layer_digests)) == (9, 2)
        assert all(len(d) == 32 for d in r.result.layer_digests)
        assert (await _health(stub)).sessions == 1
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        await _until(lambda: _sessions_are(stub, 0))
        h = await _health(stub)
        assert h.serving and h.steps == 2 and h.rows == 11


async def _sessions_are(stub, n):
    return (await _health(stub)).sessions == n


async def test_first_frame_must_be_open(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        call = stub.Session()
        await call.write(chunk_msg(1, 0, [1]))
        err = await fails_closed(call, E.SHARD_ERROR_INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT)
        assert "SessionOpen" in err.message


@pytest.mark.parametrize("frame,match", [
    (open_msg(rsid=""), "route_session_id"),
    (open_msg(epoch=0), "route_epoch"),
    (open_msg(geometry=CacheGeometry(2, 5, 8, 4)), "max_block = 8"),
    (open_msg(geometry=CacheGeometry(2, 0, 4, 4)), "window = 0"),
])
async def test_open_is_validated(tiny, frame, match):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        call = stub.Session()
        await call.write(frame)
        err = await fails_closed(call, E.SHARD_ERROR_INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT)
        assert match in err.message


async def test_stale_epoch_frame_fails_closed(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        call = await opened(stub, epoch=2)
        await call.write(chunk_msg(1, 0, [1, 2], epoch=1))
        err = await fails_closed(call, E.SHARD_ERROR_EPOCH_STALE, grpc.StatusCode.FAILED_PRECONDITION)
        assert err.idempotency_step == 1 and "epoch 1" in err.message
        assert (await _health(stub)).steps == 0  # nothing was executed


async def test_newer_epoch_supersedes_and_older_opens_are_stale(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        old = await opened(stub, epoch=1)
        new = await opened(stub, epoch=2)
        err = await fails_closed(old, E.SHARD_ERROR_EPOCH_STALE, grpc.StatusCode.FAILED_PRECONDITION)
        assert "superseded by route epoch 2" in err.message
        again = stub.Session()
        await again.write(open_msg(epoch=1))
        await fails_closed(again, E.SHARD_ERROR_EPOCH_STALE, grpc.StatusCode.FAILED_PRECONDITION)
        same = stub.Session()
        await same.write(open_msg(epoch=2))
        err = await fails_closed(same, E.SHARD_ERROR_INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT)
        assert "already open" in err.message
        for rpc, request in ((stub.Release, pb.ShardReleaseRequest(route_session_id="s", route_epoch=1)),
                             (stub.Cancel, pb.ShardCancelRequest(route_session_id="s", route_epoch=1))):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await rpc(request)
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert exc.value.details().startswith("EPOCH_STALE")
        await new.write(chunk_msg(1, 0, [1, 2], epoch=2))
        assert (await new.read()).result.next_position == 2


async def test_expired_deadline_fails_closed(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, [1, 2], deadline_ns=_past()))
        err = await fails_closed(call, E.SHARD_ERROR_DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "deadline passed" in err.message
        late_open = stub.Session()
        await late_open.write(open_msg(rsid="t", deadline_ns=_past()))
        await fails_closed(late_open, E.SHARD_ERROR_DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert (await _health(stub)).steps == 0


async def test_deadline_expired_while_queued(tiny):
    async with shard_server(_faulty(tiny, delay_s=0.3)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, [1, 2]))
        await call.write(chunk_msg(2, 2, [3], deadline_ns=time.time_ns() + 100_000_000))  # expires in the queue
        assert (await call.read()).result.idempotency_step == 1
        err = await fails_closed(call, E.SHARD_ERROR_DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert err.idempotency_step == 2


def _tensor(kind: str) -> pb.ActivationTensor:
    t = encode_tensor(np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32), fragment_bytes=256)
    frags = list(t.fragments)
    if kind == "gap":
        del t.fragments[1]
    elif kind == "overlap":
        t.fragments[1].offset -= 4
    elif kind == "crc":
        t.crc32c ^= 1
    elif kind == "flipped-bit":
        data = bytearray(frags[2].data)
        data[7] ^= 0x10
        t.fragments[2].data = bytes(data)
    elif kind == "short":
        t.fragments[-1].data = t.fragments[-1].data[:-4]
    elif kind == "shuffled":  # fragments may arrive in any order: not corrupt
        t.ClearField("fragments")
        t.fragments.extend(reversed(frags))
    return t


@pytest.mark.parametrize("kind", ["gap", "overlap", "crc", "flipped-bit", "short"])
async def test_corrupt_payload_fails_closed(tiny, kind):
    async with shard_server(_engine(tiny, LayerRange(1, 2))) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, [], hidden=_tensor(kind)))
        err = await fails_closed(call, E.SHARD_ERROR_PAYLOAD_CORRUPT, grpc.StatusCode.DATA_LOSS)
        assert err.idempotency_step == 1
        assert (await _health(stub)).steps == 0


async def test_fragments_in_any_order_are_accepted(tiny):
    async with shard_server(_engine(tiny, LayerRange(1, 2))) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, [], hidden=_tensor("shuffled")))
        assert decode_tensor((await call.read()).result.output).shape == (3, 256)


async def test_credit_exhausted_is_retryable_and_a_top_up_recovers(tiny):
    async with shard_server(_faulty(tiny, delay_s=0.3)) as (stub, _, _):
        call = stub.Session()
        await call.write(open_msg(credits=1))
        assert (await call.read()).accepted.credits == 1
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        await call.write(chunk_msg(2, 4, TOKENS[4:6]))  # no credit left while step 1 runs
        refused = await call.read()
        assert refused.error.code == E.SHARD_ERROR_FLOW_CONTROL_VIOLATION
        assert refused.error.retryable and not refused.error.session_closed and refused.error.idempotency_step == 2
        done = await call.read()
        assert done.result.idempotency_step == 1
        assert (done.flow.credits_granted, done.flow.credits_available) == (1, 1)  # the top-up
        await call.write(chunk_msg(2, 4, TOKENS[4:6]))  # the same frame again: not a duplicate
        again = await call.read()
        assert (again.result.idempotency_step, again.result.next_position) == (2, 6)


async def test_duplicate_step_is_acknowledged_not_executed(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        assert (await call.read()).result.next_position == 4
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        dup = await call.read()
        assert dup.ack.duplicate and dup.ack.idempotency_step == 1
        assert (await _health(stub)).steps == 1
        await call.write(chunk_msg(2, 4, TOKENS[4:6]))  # the session did not move
        assert (await call.read()).result.next_position == 6


async def test_cancel_signal_with_work_id_cancels_that_item_only(tiny):
    async with shard_server(_faulty(tiny, delay_s=0.3)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        await call.write(chunk_msg(2, 4, TOKENS[4:8]))
        await call.write(chunk_msg(3, 4, TOKENS[8:10]))  # as if step 2 never was
        await call.write(pb.ShardRequestFrame(cancel=pb.CancelSignal(route_epoch=1, work_id=2)))
        await call.write(pb.ShardRequestFrame(cancel=pb.CancelSignal(route_epoch=1, work_id=99)))
        replies = [await call.read() for _ in range(5)]
        acks = [r.ack for r in replies if r.HasField("ack")]
        assert [(a.idempotency_step, a.cancelled) for a in acks] == [(2, True), (99, False)]
        rest = [r for r in replies if not r.HasField("ack")]
        assert rest[0].result.idempotency_step == 1
        assert rest[1].error.code == E.SHARD_ERROR_CANCELLED and not rest[1].error.session_closed
        assert rest[1].error.idempotency_step == 2 and rest[1].flow.credits_granted == 1
        assert (rest[2].result.idempotency_step, rest[2].result.position) == (3, 4)
        ref = reference(tiny)
        ref_block(ref, TOKENS[:4])
        assert decode_tensor(rest[2].result.output).tobytes() == ref_block(ref, TOKENS[8:10]).tobytes()


async def test_cancel_signal_without_work_id_cancels_the_session(tiny):
    async with shard_server(_faulty(tiny, delay_s=0.3)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        await call.write(chunk_msg(2, 4, TOKENS[4:8]))
        await call.write(pb.ShardRequestFrame(cancel=pb.CancelSignal(route_epoch=1)))
        ack = await call.read()
        assert ack.ack.cancelled
        err = await fails_closed(call, E.SHARD_ERROR_CANCELLED, grpc.StatusCode.CANCELLED)
        assert "CancelSignal" in err.message
        await _until(lambda: _sessions_are(stub, 0))
        assert (await _health(stub)).steps <= 1  # step 2 never ran


async def test_stale_cancel_signal_fails_closed(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        call = await opened(stub, epoch=3)
        await call.write(pb.ShardRequestFrame(cancel=pb.CancelSignal(route_epoch=2)))
        await fails_closed(call, E.SHARD_ERROR_EPOCH_STALE, grpc.StatusCode.FAILED_PRECONDITION)


async def test_out_of_band_cancel_before_open_fails_that_session_closed(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        r = await stub.Cancel(pb.ShardCancelRequest(route_session_id="early", route_epoch=1))
        assert (r.session_existed, r.cancelled) == (False, True)
        call = stub.Session()
        await call.write(open_msg(rsid="early", epoch=1))
        err = await fails_closed(call, E.SHARD_ERROR_CANCELLED, grpc.StatusCode.CANCELLED)
        assert "before it opened" in err.message
        assert (await _health(stub)).sessions == 0
        r = await stub.Cancel(pb.ShardCancelRequest(route_session_id="other", route_epoch=1, work_id=4))
        assert (r.session_existed, r.cancelled) == (False, False)  # an item of no session: nothing to do
        await opened(stub, rsid="early", epoch=2)  # a newer epoch opens normally


async def test_out_of_band_cancel_of_a_live_session_and_item(tiny):
    async with shard_server(_faulty(tiny, delay_s=0.3)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        await call.write(chunk_msg(2, 0, TOKENS[4:8]))  # as if step 1 never was
        await asyncio.sleep(0.1)  # both admitted; step 1 is running
        r = await stub.Cancel(pb.ShardCancelRequest(route_session_id="s", route_epoch=1, work_id=1))
        assert (r.session_existed, r.cancelled) == (True, True)
        first = await call.read()
        assert first.error.code == E.SHARD_ERROR_CANCELLED and first.error.idempotency_step == 1
        assert not first.error.session_closed
        r = await stub.Cancel(pb.ShardCancelRequest(route_session_id="s", route_epoch=1))
        assert (r.session_existed, r.cancelled) == (True, True)
        await fails_closed(call, E.SHARD_ERROR_CANCELLED, grpc.StatusCode.CANCELLED)
        r = await stub.Cancel(pb.ShardCancelRequest(route_session_id="s", route_epoch=2))
        assert (r.session_existed, r.cancelled) == (False, True)


async def test_cancel_for_a_newer_epoch_also_ends_the_older_session(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        call = await opened(stub, epoch=1)
        r = await stub.Cancel(pb.ShardCancelRequest(route_session_id="s", route_epoch=2))
        assert (r.session_existed, r.cancelled) == (False, True)
        await fails_closed(call, E.SHARD_ERROR_CANCELLED, grpc.StatusCode.CANCELLED)


async def test_release_reports_whether_the_session_existed(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        release = pb.ShardReleaseRequest(route_session_id="s", route_epoch=1)
        assert not (await stub.Release(release)).existed
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        assert (await call.read()).result.next_position == 4
        assert (await stub.Release(release)).existed
        assert (await _health(stub)).sessions == 0  # freed when Release returns
        assert await call.read() is grpc.aio.EOF and await call.code() == grpc.StatusCode.OK
        assert not (await stub.Release(release)).existed
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Release(pb.ShardReleaseRequest(route_session_id="", route_epoch=1))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_release_while_work_is_queued(tiny):
    async with shard_server(_faulty(tiny, delay_s=0.2)) as (stub, _, _):
        call = await opened(stub)
        for step in (1, 2, 3):
            await call.write(chunk_msg(step, 4 * (step - 1), TOKENS[:4]))
        await asyncio.sleep(0.05)
        assert (await stub.Release(pb.ShardReleaseRequest(route_session_id="s", route_epoch=1))).existed
        assert (await _health(stub)).sessions == 0 and (await _health(stub)).steps <= 1


async def test_resource_exhausted(tiny):
    async with shard_server(_engine(tiny, max_sessions=1)) as (stub, _, _):
        await opened(stub, rsid="a")
        call = stub.Session()
        await call.write(open_msg(rsid="b"))
        await fails_closed(call, E.SHARD_ERROR_RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    async with shard_server(_faulty(tiny, memory_budget_bytes=1000)) as (stub, _, _):
        call = stub.Session()
        await call.write(open_msg())
        err = await fails_closed(call, E.SHARD_ERROR_RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "memory budget" in err.message


async def test_engine_crash_is_unavailable(tiny):
    async with shard_server(_faulty(tiny, crash_after=1)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        assert (await call.read()).result.next_position == 4
        await call.write(chunk_msg(2, 4, TOKENS[4:6]))
        err = await fails_closed(call, E.SHARD_ERROR_UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
        assert "crashed" in err.message
        h = await _health(stub)
        assert not h.serving and "crashed" in h.detail


async def test_position_mismatch_and_bad_frames_fail_closed(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 3, TOKENS[:4]))
        err = await fails_closed(call, E.SHARD_ERROR_FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION)
        assert "position 3" in err.message
        for frame, match in ((open_msg(rsid="t"), "unexpected open"),
                             (chunk_msg(1, 0, [1], rsid="u"), "chunk for session 'u'"),
                             (chunk_msg(0, 0, [1], rsid="t"), "idempotency_step = 0"),
                             (pb.ShardRequestFrame(decode=pb.DecodeStep(route_epoch=1, idempotency_step=1)),
                              "neither token_id nor hidden"),
                             (chunk_msg(1, 0, [999], rsid="t"), "token id 999"),
                             (pb.ShardRequestFrame(trim=pb.ShardTrim(route_epoch=1, idempotency_step=1, tokens=9)),
                              "cannot trim 9")):
            call = await opened(stub, rsid="t")
            await call.write(frame)
            code, status = ((E.SHARD_ERROR_FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION) if "trim" in match
                            else (E.SHARD_ERROR_INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT))
            err = await fails_closed(call, code, status)
            assert match in err.message
            await _until(lambda: _sessions_are(stub, 0))


class _Exploding(MlxShardEngine):
    def open_session(self, session_id, geometry):
        if session_id.startswith("boom"):
            raise ZeroDivisionError("unexpected bug in open")
        super().open_session(session_id, geometry)

    def prefill(self, session_id, work, is_cancelled=None):
        raise ZeroDivisionError("unexpected bug")

    def metrics(self):
        raise ZeroDivisionError("unexpected bug in metrics")


async def test_unexpected_engine_errors_are_internal(tiny):
    async with shard_server(_Exploding(tiny.model, LayerRange(0, 2), block=4)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        err = await fails_closed(call, E.SHARD_ERROR_INTERNAL, grpc.StatusCode.INTERNAL)
        assert "ZeroDivisionError" in err.message
        call = stub.Session()
        await call.write(open_msg(rsid="boom"))
        err = await fails_closed(call, E.SHARD_ERROR_INTERNAL, grpc.StatusCode.INTERNAL)
        assert "unexpected bug in open" in err.message
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await _health(stub)
        assert exc.value.code() == grpc.StatusCode.INTERNAL and "metrics" in exc.value.details()


async def test_forgotten_steps_still_count_as_duplicates(tiny, monkeypatch):
    monkeypatch.setattr(session_stream, "REMEMBERED_STEPS", 2)
    async with shard_server(_engine(tiny)) as (stub, _, _):
        call = await opened(stub)
        for step in (1, 2, 3):
            await call.write(chunk_msg(step, step - 1, [step]))
            assert (await call.read()).result.idempotency_step == step
        await call.write(chunk_msg(1, 3, [9]))  # step 1 was forgotten: at or below the floor
        assert (await call.read()).ack.duplicate
        await call.write(chunk_msg(5, 3, [9]))  # a gap in steps is fine
        assert (await call.read()).result.next_position == 4


async def test_client_disconnect_releases_the_session(tiny):
    async with shard_server(_faulty(tiny, delay_s=0.2)) as (stub, _, _):
        call = await opened(stub)
        await call.write(chunk_msg(1, 0, TOKENS[:4]))
        call.cancel()
        await _until(lambda: _sessions_are(stub, 0))
        empty = stub.Session()
        await empty.done_writing()  # a stream that never opens ends quietly
        assert await empty.read() is grpc.aio.EOF


async def test_worker_shutdown_fails_sessions_unavailable(tiny):
    async with shard_server(_engine(tiny)) as (stub, _, servicer):
        call = await opened(stub)
        servicer.fail_sessions("going away")
        err = await fails_closed(call, E.SHARD_ERROR_UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
        assert "going away" in err.message
