"""Negative controls: each invariance battery's own comparison, shown to see a one-bit defect.

Batching, shard routes and snapshots are tested by equality (solo = batched, route = single
process, restored = original). An equality that could not fail would pass the same way, so
each comparison here runs twice: clean (it finds nothing) and with a defect injected by a
TEST FIXTURE (it reports the difference):
- batching: a batch-variant kernel, one bit of every row flipped when the forward holds more
  rows than the row's own session's (two sessions decoding together, say);
- route: a shard worker whose N-th output has one activation bit flipped (FaultConfig.flip_bit);
- snapshots: one K/V bit flipped in the file, its checksum (and state digest) recomputed.
"""

from __future__ import annotations

import contextlib

import grpc
import mlx.core as mx
import numpy as np
import pytest

from inference_engine.client.snapshots import restore_bytes, snapshot_bytes
from inference_engine.model import forward as forward_module
from inference_engine.runtime.engine import Engine
from inference_engine.session import snapshot_format as fmt
from inference_engine.shard.client.pipeline import ShardPipeline
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.verifier.sink_window_verifier import state_digest
from tests.batching_helpers import GREEDY, LOOKUP, Scenario, batch_differences, random_tokens
from tests.conftest import running_server
from tests.fixtures.fault_config import FaultConfig
from tests.fixtures.fault_injection import FaultInjectingEngine
from tests.kernel_guard import assert_full_tile
from tests.shard_contract import PATTERNS, TOKENS
from tests.shard_helpers import GEOMETRY, chain_differences, ref_block, reference, shard_server
from tests.snapshot_helpers import flip_kv_bit, greedy_with_logprobs, restore_differences


@pytest.fixture(scope="module")
def engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield e
    e.close()


# ---- batching ----------------------------------------------------------------------------------

def _batch_variant(block):
    """TEST FIXTURE: transformer block 0 made batch-variant, as a BLAS whose bits depend on the call's row count.

    Rows computed in a forward with more rows than their own session's (any batched forward)
    leave the block with their first hidden value's lowest bit flipped; a session's rows
    computed alone are untouched.
    """

    def variant(layer, family, h, positions, segments, i, native):
        out = block(layer, family, h, positions, segments, i, native)  # (1, R, hidden)
        if i != 0 or len(segments) < 2:
            return out
        first = (mx.arange(out.shape[-1]) == 0).astype(mx.uint32)  # (hidden,)
        return mx.view(mx.view(out, mx.uint32) ^ first, mx.float32)

    return variant


# Windows hold every position (nothing a batched forward touched scrolls out before the last digest).
BATCHED = [
    Scenario(2, 64, random_tokens(31, 11, 256), (("gen", 20, GREEDY, 1),)),
    Scenario(4, 64, random_tokens(32, 25, 256), (("gen", 8, LOOKUP, 3), ("append", random_tokens(33, 5, 256)),
                                                 ("gen", 10, GREEDY, 1)), 0.01),
]


@pytest.mark.parametrize("defect", [False, True], ids=["clean", "batch-variant"])
async def test_batching_comparison_sees_a_batch_variant_kernel(engine, monkeypatch, defect):
    if defect:
        monkeypatch.setattr(forward_module, "_block", _batch_variant(forward_module._block))
    changed, most = await batch_differences(engine, BATCHED)
    assert most >= 2  # rows of both sessions shared a forward in the concurrent run: the defect hit both
    assert changed == ([0, 1] if defect else [])


# ---- shard routes ------------------------------------------------------------------------------

def _mlx(model, layers: LayerRange) -> MlxShardEngine:
    return MlxShardEngine(model, layers, block=4, max_rollback=4)


@pytest.mark.parametrize("flip_bit", [0, 3], ids=["clean", "head flips output 3"])
def test_chain_comparison_sees_one_flipped_activation_bit(tiny, flip_bit):
    """The shard contract's route-vs-single-process comparison, the head's third hidden output off by one bit."""
    assert FaultConfig.parse(f"flip_bit={flip_bit}") == FaultConfig(flip_bit=flip_bit)  # as fault_worker takes it
    chain = [FaultInjectingEngine(_mlx(tiny.model, LayerRange(0, 1)), FaultConfig(flip_bit=flip_bit)),
             _mlx(tiny.model, LayerRange(1, 2))]
    for e in chain:
        e.load()
        e.open_session("s", GEOMETRY)
    differ = chain_differences(chain, tiny, "s", TOKENS, PATTERNS["mixed"])
    if flip_bit:
        assert differ[0] == flip_bit  # nothing before the flip; the flipped block itself is seen
    else:
        assert differ == []


@contextlib.asynccontextmanager
async def _pipeline(tiny, head_faults: FaultConfig):
    head = FaultInjectingEngine(_mlx(tiny.model, LayerRange(0, 1)), head_faults)
    async with shard_server(head) as (_, a, _), shard_server(_mlx(tiny.model, LayerRange(1, 2))) as (_, b, _):
        async with ShardPipeline([a, b]) as pipeline:
            yield pipeline


@pytest.mark.parametrize("flip_bit", [0, 4], ids=["clean", "head flips output 4"])
async def test_route_over_grpc_sees_one_flipped_activation_bit(tiny, flip_bit):
    """A route of two workers over real gRPC: its logits and its state digest against the single process.

    Output 4 is position 16's row, still in the window (sink 2, window 5) when the digests are taken.
    """
    async with _pipeline(tiny, FaultConfig(flip_bit=flip_bit)) as p:
        geometry = await p.open("s", sink=2, window=5)
        ref, position, differ = reference(tiny, geometry), 0, []
        for step, n in enumerate((9, 1, 6, 1, 4), start=1):
            got = await p.forward("s", TOKENS[position : position + n])
            if got.tobytes() != ref_block(ref, TOKENS[position : position + n]).tobytes():
                differ.append(step)
            position += n
        digests = await p.layer_digests("s")
        route_digest = state_digest(mx.array(got[-1]), ref.cached_token_sequence, p.position("s"), digests)
    if flip_bit:
        assert differ[0] == flip_bit and digests != ref.executor.layer_digests()
        assert route_digest != ref.state_digest()
    else:
        assert differ == [] and route_digest == ref.state_digest()


# ---- snapshots ---------------------------------------------------------------------------------

PROMPT = np.random.default_rng(9).integers(2, 256, 40).tolist()


async def _talked(stub) -> str:
    """A session past its window wrap (sink 4, window 16), with speculative rollbacks."""
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=4, window_tokens=16))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
    async for _ in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=6, ignore_eos=True,
                                                    mode=pb.DECODE_MODE_SPECULATIVE_LOOKUP, num_draft_tokens=4)):
        pass
    return sid


@pytest.mark.parametrize("section", [None, "keys", "values"], ids=["clean", "keys", "values"])
async def test_snapshot_comparison_sees_one_flipped_kv_bit(engine, section):
    """A forged file, checksum and state digest recomputed, restores; the snapshot battery's comparison sees it."""
    async with running_server(engine) as (stub, _):
        sid = await _talked(stub)
        data = await snapshot_bytes(stub, sid)
        assert fmt.encode(fmt.decode(data)) == data  # decoding and re-encoding alone change nothing
        forged = data if section is None else flip_kv_bit(data, section)
        assert fmt.decode(forged).tokens.tolist() == fmt.decode(data).tokens.tolist()  # a sound file
        differ = await restore_differences(stub, sid, forged)
    if section is None:
        assert differ == []
    else:
        # The tokens alone stay the same (one ulp rarely moves an argmax): the digests are what sees it.
        assert differ[0] == "digest at restore" and differ[-1] == "digest after" and "next tokens" not in differ
    if section == "values":  # a value's last bit moves the next logits: their log-softmax differs too
        assert "next logprobs" in differ


async def test_a_forged_kv_bit_under_the_old_digest_is_refused(engine):
    """Only the checksum recomputed: the restore's own digest check refuses the file, nothing restored."""
    async with running_server(engine) as (stub, runtime):
        sid = await _talked(stub)
        before = runtime.store.slabs_in_use
        forged = flip_kv_bit(await snapshot_bytes(stub, sid), "keys", reseal=False)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await restore_bytes(stub, forged)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not the" in err.value.details() and "nothing was restored" in err.value.details()
        assert runtime.store.slabs_in_use == before
        assert (await greedy_with_logprobs(stub, sid, 2))[0]  # the original is intact
