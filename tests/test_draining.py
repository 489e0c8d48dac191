"""A draining server (SIGTERM received, in-flight calls finishing) starts nothing new: every call that
would make a session or start work on one is UNAVAILABLE, over a real grpc.aio server (tiny model),
and the pool and the existing session are left as they were."""

import grpc
import pytest

from inference_engine.client.snapshots import restore_bytes, snapshot_bytes
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server


async def _refused(coro) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    return err.value.details()


async def test_a_draining_server_makes_no_session_and_starts_no_work(tiny_engine):
    async with running_server(tiny_engine) as (stub, runtime):
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[5, 6, 7]))
        data = await snapshot_bytes(stub, sid)
        before = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        in_use = runtime.store.slabs_in_use
        await runtime.drain(0.1)  # what SIGTERM does first (no stream runs: it returns at once)
        for call in (stub.CreateSession(pb.CreateSessionRequest()),
                     stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[8])),
                     restore_bytes(stub, data),
                     stub.ForkSession(pb.ForkSessionRequest(session_id=sid))):
            assert "shutting down" in await _refused(call)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=2)):
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert runtime.store.slabs_in_use == in_use  # nothing was made, nothing leaked
        after = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert (after.history_length, after.state_digest) == (before.history_length, before.state_digest)
        assert len(await snapshot_bytes(stub, sid)) == len(data)  # reading a session's state still works
