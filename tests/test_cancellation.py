"""Nothing a client did not see succeed is ever committed (tiny model, real gRPC).

Each test reproduces a race found by the hostile probe of issue 15: a timed-out append that
was committed anyway, GetSessionInfo showing a token no stream sent, CloseSession one token
short of the stream's final message, an append that returned OK on a closed session.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server

PROMPT = [5, 17, 33, 2, 250, 9, 9, 120, 64, 3]
LONG = [(7 * i) % 250 + 1 for i in range(8192)]  # hundreds of blocks on the tiny model


async def _session(stub, tokens=PROMPT) -> str:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=2, window_tokens=32))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=tokens))
    return sid


async def _info(stub, sid: str) -> pb.GetSessionInfoResponse:
    return await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))


async def _digest_of(stub, tokens: list[int]) -> str:
    """The digest of a fresh session fed `tokens` (what a replay of the client's view gives)."""
    sid = await _session(stub, tokens)
    digest = (await _info(stub, sid)).state_digest
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return digest


async def _streaming(stub):
    """A Generate of another session, streaming: an append runs in slices beside it, so it is still
    running 0.15 s later (alone, the tiny model can finish LONG sooner). Cancel it when done."""
    stream = stub.Generate(pb.GenerateRequest(session_id=await _session(stub), max_new_tokens=1000, ignore_eos=True))
    await stream.read()
    return stream


async def test_timed_out_append_leaves_the_history_as_before(tiny_engine):
    async with running_server(tiny_engine) as (stub, _):
        sid = await _session(stub)
        before = await _info(stub, sid)
        other = await _streaming(stub)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=LONG), timeout=0.15)
        other.cancel()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        after = await _info(stub, sid)  # waits for the abandoned append to be undone
        assert (after.history_length, after.state_digest) == (before.history_length, before.state_digest)
        r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=LONG[:40]))  # a retry is exact
        assert r.history_length == len(PROMPT) + 40
        assert (await _info(stub, sid)).state_digest == await _digest_of(stub, PROMPT + LONG[:40])


async def test_cancelled_append_stops_and_changes_nothing(tiny_engine):
    async with running_server(tiny_engine) as (stub, _):
        sid = await _session(stub)
        before = await _info(stub, sid)
        other = await _streaming(stub)
        call = stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=LONG))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        other.cancel()
        after = await _info(stub, sid)
        assert (after.history_length, after.state_digest) == (before.history_length, before.state_digest)


async def test_info_after_a_cancelled_generate_shows_only_sent_tokens(tiny_engine):
    """The history holds what the server wrote to the stream: what the client read, plus the messages still in
    flight when it cancelled (gRPC accepts writes ahead of the reader: how many depends on how fast a step is,
    so only the lower bound is fixed); GetSessionInfo shows exactly a prefix of the stream at once and never
    changes its mind later."""
    async with running_server(tiny_engine) as (stub, _):
        ref = await _session(stub)
        reference = [t async for m in stub.Generate(pb.GenerateRequest(session_id=ref, max_new_tokens=8,
                                                                         ignore_eos=True)) for t in m.tokens]
        for reads in (1, 2, 5):
            sid = await _session(stub)
            stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=500, ignore_eos=True))
            seen: list[int] = []
            for _ in range(reads):
                seen += list((await stream.read()).tokens)
            stream.cancel()
            info = await _info(stub, sid)  # at once: no unsent step may show
            committed = info.history_length - len(PROMPT)
            if committed > len(reference):  # the stream ran further ahead than the reference: extend it
                longer = await _session(stub)
                reference = [t async for m in stub.Generate(pb.GenerateRequest(
                    session_id=longer, max_new_tokens=committed, ignore_eos=True)) for t in m.tokens]
                await stub.CloseSession(pb.CloseSessionRequest(session_id=longer))
            assert seen == reference[:reads] and committed >= reads
            assert info.state_digest == await _digest_of(stub, PROMPT + reference[:committed])
            await asyncio.sleep(0.3)
            later = await _info(stub, sid)
            assert (later.history_length, later.state_digest) == (info.history_length, info.state_digest)
            await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


async def test_close_reports_the_final_history_of_a_running_stream(tiny_engine):
    async with running_server(tiny_engine) as (stub, _):
        sid = await _session(stub)
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=2000, ignore_eos=True))
        first = await stream.read()
        closed = await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        messages = [first]
        while (m := await stream.read()) is not grpc.aio.EOF:
            messages.append(m)
        sent = sum(len(m.tokens) for m in messages)
        assert messages[-1].stop_reason == pb.STOP_REASON_CANCELLED
        assert closed.history_length == messages[-1].history_length == len(PROMPT) + sent


async def test_append_racing_a_close_fails_or_is_reported(tiny_engine):
    async with running_server(tiny_engine) as (stub, _):
        for delay in (0.0, 0.05):
            sid = await _session(stub)
            append = asyncio.ensure_future(stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=LONG)))
            await asyncio.sleep(delay)
            closed = await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            try:
                r = await append
                assert closed.history_length == r.history_length == len(PROMPT) + len(LONG)  # done first
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND and "closed" in exc.details()
                assert closed.history_length == len(PROMPT)  # nothing of it was committed


async def test_expected_history_length_makes_retries_safe(tiny_engine):
    async with running_server(tiny_engine) as (stub, _):
        sid = await _session(stub)
        r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1, 2], expected_history_length=10))
        assert r.history_length == 12
        before = await _info(stub, sid)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the retry of a call that did go through
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1, 2], expected_history_length=10))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "expected_history_length is 10 but the session holds 12 tokens" in err.value.details()
        after = await _info(stub, sid)
        assert (after.history_length, after.state_digest) == (before.history_length, before.state_digest)
        r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[3], expected_history_length=12))
        assert r.history_length == 13
