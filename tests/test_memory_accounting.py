"""The pool counts every byte a session can hold, draft cache included (tiny model, real gRPC)."""

from __future__ import annotations

import grpc
import pytest

from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.kernel_guard import tiny_drafted_engine

PROMPT = [5, 17, 33, 2, 250, 9, 9, 120, 64, 3]


@pytest.fixture(scope="module")
def engine(tiny):
    e = tiny_drafted_engine(tiny)
    yield e
    e.close()


async def _generate(stub, sid: str, mode: int) -> None:
    async for _ in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=6, ignore_eos=True, mode=mode)):
        pass


async def test_draft_cache_is_counted_and_bounded(engine):
    slab, draft = engine.slab_bytes(2, 32), engine.draft_slab_bytes(2, 32)
    assert slab > 0 and draft > 0
    async with running_server(engine, max_kv_bytes=2 * slab + draft // 2) as (stub, runtime):
        a = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=2, window_tokens=32))).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=a, tokens=PROMPT))
        assert (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=a))).kv_bytes == slab
        await _generate(stub, a, pb.DECODE_MODE_SPECULATIVE_DRAFT)  # the draft cache joins the session
        assert (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=a))).kv_bytes == slab + draft
        assert runtime.store.kv_bytes_in_use() == slab + draft
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a second slab would pass the bound
            await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=2, window_tokens=32))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-kv-bytes is {2 * slab + draft // 2}" in err.value.details()
        await stub.CloseSession(pb.CloseSessionRequest(session_id=a))
        assert runtime.store.kv_bytes_in_use() == 0
        b = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=2, window_tokens=32))).session_id
        c = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=2, window_tokens=32))).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=b, tokens=PROMPT))
        with pytest.raises(grpc.aio.AioRpcError) as err:  # two slabs in use: no room for a draft cache
            await _generate(stub, b, pb.DECODE_MODE_SPECULATIVE_DRAFT)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-kv-bytes" in err.value.details()
        await _generate(stub, b, pb.DECODE_MODE_GREEDY)  # the session is intact
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=b))
        assert info.history_length == len(PROMPT) + 6 and info.kv_bytes == slab
        for sid in (b, c):
            await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
