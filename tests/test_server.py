"""RuntimeService over a real grpc.aio server on 127.0.0.1:0 (tiny random model)."""

import asyncio

import grpc
import pytest

from inference_engine.runtime.engine import Engine
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.kernel_guard import assert_full_tile

PROMPT = [5, 17, 33, 2, 250, 9, 9, 120, 64, 3]


@pytest.fixture(scope="module")
def engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield e
    e.close()


async def _create(stub, **kw):
    return (await stub.CreateSession(pb.CreateSessionRequest(**kw))).session_id


async def _generate(stub, sid, n, **kw):
    tokens, last = [], None
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, **kw)):
        tokens += list(msg.tokens)
        last = msg
    return tokens, last


async def _drain(stream):
    """Read a streaming call to its end with the read() API; returns all messages."""
    out = []
    while (msg := await stream.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def _code(coro):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value.code(), err.value.details()


async def test_session_lifecycle(engine):
    async with running_server(engine) as (stub, _):
        sid = await _create(stub, client_label="lifecycle", eos_token_ids=[7])
        r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        assert (r.history_length, r.next_global_position) == (10, 10)
        tokens, last = await _generate(stub, sid, 6, ignore_eos=True)
        assert len(tokens) == 6 and last.stop_reason == pb.STOP_REASON_MAX_TOKENS and last.history_length == 16
        r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1, 2]))
        assert r.history_length == 18
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert info.history_length == info.next_global_position == 18
        assert info.cached_tokens == 18 and info.window_tokens == 64 and info.sink_tokens == 4
        assert list(info.eos_token_ids) == [7] and info.client_label == "lifecycle"
        assert info.exact and len(info.state_digest) == 64 and info.kv_bytes > 0
        assert info.last_used_unix_nanos >= info.created_unix_nanos > 0
        closed = await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        assert closed.history_length == 18
        for call in (
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid)),
            stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid)),
            stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1])),
            _generate(stub, sid, 1),
        ):
            code, details = await _code(call)
            assert code == grpc.StatusCode.NOT_FOUND and sid in details


async def test_generation_is_greedy_and_continues_history(engine):
    async with running_server(engine) as (stub, _):
        a = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=a, tokens=PROMPT))
        first, _ = await _generate(stub, a, 5, ignore_eos=True)
        second, _ = await _generate(stub, a, 5, ignore_eos=True)
        b = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=b, tokens=PROMPT))
        whole, _ = await _generate(stub, b, 10, ignore_eos=True)
        assert first + second == whole
        # A third session fed the generated tokens as a prompt reaches the same state.
        c = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=c, tokens=PROMPT + whole))
        digests = [
            (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=s))).state_digest for s in (a, b, c)
        ]
        assert len(set(digests)) == 1


async def test_eos_stops_and_joins_history(engine):
    async with running_server(engine) as (stub, _):
        probe = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=probe, tokens=PROMPT))
        greedy, _ = await _generate(stub, probe, 4, ignore_eos=True)
        sid = await _create(stub, eos_token_ids=[greedy[2]])
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        tokens, last = await _generate(stub, sid, 50)
        assert tokens == greedy[: greedy.index(greedy[2]) + 1]
        assert last.stop_reason == pb.STOP_REASON_EOS and last.history_length == len(PROMPT) + len(tokens)


@pytest.mark.parametrize(
    "call,fragment",
    [
        (lambda s, sid: s.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[256])), "vocab size 256"),
        (lambda s, sid: s.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[])), "exactly one of tokens, text, messages; got none"),
        (lambda s, sid: s.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1] * 8193)), "8193"),
        (lambda s, sid: _generate(s, sid, 4097), "allowed 1..4096 (or 0: the server default)"),
        (lambda s, sid: s.CreateSession(pb.CreateSessionRequest(sink_tokens=65)), "sink_tokens = 65"),
        (lambda s, sid: s.CreateSession(pb.CreateSessionRequest(window_tokens=8193)), "window_tokens"),
        (lambda s, sid: s.CreateSession(pb.CreateSessionRequest(eos_token_ids=[300])), "eos_token_ids[0] = 300"),
        (lambda s, sid: s.CreateSession(pb.CreateSessionRequest(client_label="x" * 257)), "client_label"),
        (lambda s, sid: s.GetSessionInfo(pb.GetSessionInfoRequest(session_id="")),
         "session_id has 0 characters; allowed 1..128"),
        (lambda s, sid: s.CreateSession(pb.CreateSessionRequest(client_label="x" * 257)),
         "client_label has 257 characters; allowed 0..256"),
        (lambda s, sid: s.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1] * 8193)),
         "tokens has 8193 elements; allowed 1..8192"),
        (lambda s, sid: _generate(s, sid, 4, temperature=1.0, top_k=257), "allowed 1..256 (or 0: all tokens)"),
        (lambda s, sid: _generate(s, sid, 4, logprobs=True, top_logprobs=21), "allowed 1..20 (or 0: no alternatives)"),
    ],
)
async def test_invalid_arguments_leave_session_intact(engine, call, fragment):
    async with running_server(engine) as (stub, _):
        sid = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        before = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        code, details = await _code(call(stub, sid))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details
        after = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert after.state_digest == before.state_digest and after.history_length == before.history_length


async def test_generate_before_append_is_failed_precondition(engine):
    async with running_server(engine) as (stub, _):
        sid = await _create(stub)
        code, details = await _code(_generate(stub, sid, 3))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "AppendTokens" in details
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        tokens, _ = await _generate(stub, sid, 3, ignore_eos=True)
        assert len(tokens) == 3


async def test_pool_exhaustion_and_reuse(engine):
    async with running_server(engine, max_sessions=2) as (stub, _):
        a, b = await _create(stub), await _create(stub)
        code, details = await _code(stub.CreateSession(pb.CreateSessionRequest()))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 session slabs" in details
        await stub.CloseSession(pb.CloseSessionRequest(session_id=a))
        c = await _create(stub)
        assert len({a, b, c}) == 3 and all(len(x) >= 20 for x in (a, b, c))


async def test_idle_sessions_expire(engine):
    async with running_server(engine, session_ttl_s=0.3) as (stub, runtime):
        sid = await _create(stub)
        await asyncio.sleep(0.8)
        code, _ = await _code(stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid)))
        assert code == grpc.StatusCode.NOT_FOUND
        assert runtime.store.slabs_in_use == 0


async def test_overlapping_calls_are_aborted_and_session_survives(engine):
    async with running_server(engine) as (stub, _):
        sid = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=200, ignore_eos=True))
        received = list((await stream.read()).tokens)
        code, details = await _code(stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1])))
        assert code == grpc.StatusCode.ABORTED and "busy" in details
        code, _ = await _code(_generate(stub, sid, 2))
        assert code == grpc.StatusCode.ABORTED
        for msg in await _drain(stream):
            received += list(msg.tokens)
        assert len(received) == 200
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert info.history_length == info.next_global_position == len(PROMPT) + 200


async def test_client_cancel_keeps_exactly_sent_tokens(engine):
    async with running_server(engine) as (stub, runtime):
        sid = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=4000, ignore_eos=True))
        received = []
        for _ in range(5):
            received += list((await stream.read()).tokens)
        stream.cancel()
        for _ in range(100):  # the server notices within one step
            await asyncio.sleep(0.02)
            session = runtime.store.get(sid)
            if not session.is_busy:
                break
        assert not session.is_busy
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert info.history_length == info.next_global_position
        sent = session.history[len(PROMPT):]
        assert sent[:5] == received and len(sent) < 4000
        # The session holds exactly a greedy prefix and keeps generating from it.
        ref = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=ref, tokens=PROMPT))
        greedy, _ = await _generate(stub, ref, len(sent) + 3, ignore_eos=True)
        more, _ = await _generate(stub, sid, 3, ignore_eos=True)
        assert sent + more == greedy


async def test_close_during_generate_ends_stream_cancelled(engine):
    async with running_server(engine) as (stub, runtime):
        sid = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=4000, ignore_eos=True))
        await stream.read()
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        last = (await _drain(stream))[-1]
        assert last.stop_reason == pb.STOP_REASON_CANCELLED
        assert runtime.store.slabs_in_use == 0


async def test_shutdown_ends_generation_cancelled(engine):
    async with running_server(engine) as (stub, runtime):
        sid = await _create(stub)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=4000, ignore_eos=True))
        await stream.read()
        runtime.is_shutting_down = True
        last = (await _drain(stream))[-1]
        assert last.stop_reason == pb.STOP_REASON_CANCELLED
