"""Snapshots on the packaged SmolLM2-135M over real gRPC: a restored session's digest and every later
token equal the original's, mid-conversation, after the window wrapped, after speculative rollbacks
and at the default window; forks equal a fresh session fed the whole history; and a session on a
shard route snapshots to the same file as in one process, and restores onto either."""

import contextlib

import numpy as np
import pytest

from inference_engine.client.snapshots import restore_bytes, snapshot_bytes
from inference_engine.runtime.engine import Engine
from inference_engine.session.snapshot_format import decode
from inference_engine.shard.client.route import ShardRoute
from inference_engine.shard.client.route_backend import RouteBackend
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.kernel_guard import assert_full_tile
from tests.shard_helpers import shard_server
from tests.snapshot_helpers import restore_differences

pytestmark = pytest.mark.real_model
SINK, WINDOW = 4, 32
VOCAB = 49152
PROMPT = np.random.default_rng(21).integers(0, VOCAB, 20).tolist()
# A prompt the answer copies from: prompt lookup drafts, and some drafts are rejected (rolled back).
REPEAT = np.random.default_rng(22).integers(0, VOCAB, 12).tolist() * 3


async def _session(stub, tokens, window=WINDOW) -> str:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=window))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=tokens))
    return sid


async def _generate(stub, sid, n, mode=pb.DECODE_MODE_GREEDY) -> tuple[list[int], pb.GenerateResponse]:
    tokens, last = [], None
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, mode=mode,
                                                      num_draft_tokens=4)):
        tokens += list(msg.tokens)
        last = msg
    return tokens, last


async def _digest(stub, sid) -> str:
    return (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest


async def _check_restore_continues(stub, sid, n: int = 6) -> bytes:
    """Snapshot `sid`, restore it, and check the copy against the original (digests, next `n` tokens, logprobs)."""
    data = await snapshot_bytes(stub, sid)
    assert await restore_differences(stub, sid, data, n) == []
    return data


async def test_restore_is_bitwise_mid_conversation_after_wrap_and_rollbacks(real_engine):
    async with running_server(real_engine) as (stub, _):
        sid = await _session(stub, PROMPT)
        await _check_restore_continues(stub, sid)  # mid-conversation: 20 + 6 tokens, the window not full
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[::-1] + PROMPT))
        await _generate(stub, sid, 10)
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert info.history_length > SINK + WINDOW + 16 + 9  # the ring wrapped
        await _check_restore_continues(stub, sid)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=REPEAT))
        _, last = await _generate(stub, sid, 12, pb.DECODE_MODE_SPECULATIVE_LOOKUP)
        assert last.drafted_tokens > last.accepted_tokens  # some drafts were rolled back
        await _check_restore_continues(stub, sid)


async def test_restore_at_the_default_window_and_forks(real_engine):
    async with running_server(real_engine, default_window=1024) as (stub, _):
        history = np.random.default_rng(23).integers(0, VOCAB, 150).tolist()
        sid = await _session(stub, history, window=0)
        data = await _check_restore_continues(stub, sid, n=4)
        assert len(data) > 2 * 30 * 3 * 150 * 64 * 4  # canonical K/V of 150 positions, 30 layers
        await _generate(stub, sid, 4)
        forks = [(await stub.ForkSession(pb.ForkSessionRequest(session_id=sid))).session_id for _ in range(2)]
        whole = decode(await snapshot_bytes(stub, sid)).tokens.tolist()  # the history, generated tokens included
        assert whole[: len(history)] == history and len(whole) == len(history) + 8
        more = PROMPT[:7]
        for f in forks:
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=f, tokens=more))
        fresh = await _session(stub, whole + more, window=0)
        assert len({await _digest(stub, s) for s in forks + [fresh]}) == 1
        streams = [(await _generate(stub, s, 5))[0] for s in forks + [fresh]]
        assert streams[0] == streams[1] == streams[2]


@contextlib.asynccontextmanager
async def _route_engine(real_model, block: int):
    """An engine whose target runs on a 2-worker route of in-process shard workers over real gRPC."""
    workers = [MlxShardEngine(real_model.model, LayerRange(a, b), block=block, max_rollback=16)
               for a, b in ((0, 15), (15, 30))]
    engine = assert_full_tile(Engine(real_model, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    async with contextlib.AsyncExitStack() as stack:
        addresses = [(await stack.enter_async_context(shard_server(w)))[1] for w in workers]
        route = ShardRoute(addresses, 5.0, retry_interval_s=0.1)
        await route.start()
        engine.use_backend(RouteBackend(route, real_model.spec, engine.block))
        try:
            yield engine
        finally:
            route.is_closed = True
            engine.close()
            await route.stop()


async def _script(stub) -> str:
    """A session past the window wrap with speculative rollbacks."""
    sid = await _session(stub, PROMPT + REPEAT)
    await _generate(stub, sid, 8, pb.DECODE_MODE_SPECULATIVE_LOOKUP)
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[:9]))
    return sid


async def test_a_routed_snapshot_is_the_single_process_file(real_model, real_engine):
    async with running_server(real_engine) as (stub, _):
        local = await _script(stub)
        local_file = await snapshot_bytes(stub, local)
        async with _route_engine(real_model, real_engine.block) as routed, running_server(routed) as (rstub, _):
            remote = await _script(rstub)
            assert await snapshot_bytes(rstub, remote) == local_file  # the same bytes
            onto_route = await restore_bytes(rstub, local_file)
            want, _ = await _generate(stub, local, 6)
            got, _ = await _generate(rstub, onto_route.session_id, 6)
            assert got == want and await _digest(rstub, onto_route.session_id) == await _digest(stub, local)
            routed_file = await snapshot_bytes(rstub, onto_route.session_id)
            onto_local = await restore_bytes(stub, routed_file)
            assert onto_local.state_digest == await _digest(stub, local)
            fork = await rstub.ForkSession(pb.ForkSessionRequest(session_id=onto_route.session_id))
            assert fork.state_digest == onto_local.state_digest
            a, _ = await _generate(stub, onto_local.session_id, 5)
            b, _ = await _generate(rstub, fork.session_id, 5)
            assert a == b
