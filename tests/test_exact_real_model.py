"""INV-3 on the real packaged model: any chunking, across window wrap and rollback, bitwise.

Sink 4 + window 32, sequences of 120 tokens (> 3 x (sink + window)). "Identical" means the
state digest: next-token logits bytes, cached token sequence, position and cached K/V bytes.
"""

import numpy as np
import pytest

from inference_engine.config import ServerConfig
from inference_engine.model import forward as forward_module
from inference_engine.runtime.engine import Engine
from inference_engine.serving_path import EXACT_SUFFIX, kernels_in_use
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.exactness import chunkings, feed, rows_variant
from tests.kernel_guard import assert_full_tile, is_kernel_bound

pytestmark = pytest.mark.real_model

SINK, WINDOW, N = 4, 32, 120
CHUNKINGS = {**chunkings(N), "straddle wrap": [30, 10, 80], "tile edges": [11, 12, 13, 1, 24, 59],
             "64-row edges": [63, 1, 1, 55], "past 64": [65, 55]}


@pytest.fixture(scope="module")
def real_engine(real_model):
    """The exact engine at the server's default largest tile (64), not conftest's 16."""
    e = assert_full_tile(Engine(real_model, exact=True, max_tile=ServerConfig().max_tile, plain_block=64,
                                max_rollback=8))
    yield e
    e.close()


@pytest.fixture(scope="module")
def tokens(real_model):
    return np.random.default_rng(7).integers(0, real_model.spec.vocab_size, N).tolist()


@pytest.fixture(scope="module")
def reference(real_engine, tokens):
    return feed(real_engine, tokens, [N], SINK, WINDOW)


def test_the_exact_kernels_serve_and_the_tile_is_probed(real_engine):
    assert real_engine.is_exact and ServerConfig().max_tile == 64
    if is_kernel_bound():  # always on Linux (conftest): every product on the exact kernels, with or without LD_PRELOAD
        assert kernels_in_use().startswith("exact-gemm kernel") and kernels_in_use().endswith(EXACT_SUFFIX)
        assert real_engine.block == 64


@pytest.mark.parametrize("name", sorted(CHUNKINGS))
def test_chunking_invariance(real_engine, tokens, reference, name):
    v = feed(real_engine, tokens, CHUNKINGS[name], SINK, WINDOW)
    assert v.next_global_position == N
    assert v.cached_token_sequence == tokens[:SINK] + tokens[-WINDOW:]
    assert np.array(v.next_token_logits).tobytes() == np.array(reference.next_token_logits).tobytes()
    assert v.state_digest() == reference.state_digest()


@pytest.mark.parametrize("fed,block,accepted", [(60, 8, 0), (60, 8, 3), (100, 5, 4), (37, 8, 8)])
def test_rollback_after_wrap(real_engine, tokens, fed, block, accepted):
    v = feed(real_engine, tokens, [fed], SINK, WINDOW)
    drafted = list(reversed(tokens[fed : fed + block]))  # mostly wrong guesses
    v.forward_block(drafted)
    v.commit_or_truncate(block, accepted)
    same = feed(real_engine, tokens[:fed] + drafted[:accepted], [fed + accepted], SINK, WINDOW)
    assert v.state_digest() == same.state_digest()
    # Continue with the true tokens: a rolled-back block leaves no trace.
    rest = tokens[fed : fed + 10]
    v.forward_block(rest)
    v.commit_or_truncate(len(rest), len(rest))
    ref = feed(real_engine, tokens[:fed] + drafted[:accepted] + rest, [fed + accepted + len(rest)], SINK, WINDOW)
    assert v.state_digest() == ref.state_digest()


async def test_two_sessions_through_server(real_engine, tokens):
    sizes = CHUNKINGS["random1"]
    async with running_server(real_engine) as (stub, _):
        sids = []
        for plan in ([N], sizes):
            sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
            i = 0
            for n in plan:
                await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=tokens[i : i + n]))
                i += n
            sids.append(sid)
        infos = [await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=s)) for s in sids]
        assert infos[0].state_digest == infos[1].state_digest and infos[0].exact
        streams = []
        for sid in sids:
            got = []
            async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=12, ignore_eos=True)):
                got += list(msg.tokens)
            streams.append(got)
        assert streams[0] == streams[1] and len(streams[0]) == 12
        infos = [await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=s)) for s in sids]
        assert infos[0].state_digest == infos[1].state_digest


@pytest.mark.parametrize("defect", [False, True], ids=["clean", "rows-variant"])
def test_negative_control_plain_blocks_of_128(real_model, tokens, monkeypatch, defect):
    """Plain 128-row blocks: the exact kernels keep them chunking-invariant (any row count); the chunking
    comparison sees a product whose bits depend on the row count."""
    if defect:
        monkeypatch.setattr(forward_module, "_block", rows_variant(forward_module._block))
    plain = Engine(real_model, exact=False, max_tile=16, plain_block=128, max_rollback=8)
    try:
        digests = {name: feed(plain, tokens, CHUNKINGS[name], SINK, WINDOW).state_digest()
                   for name in ("1xN", "random0", "past 64")}
    finally:
        plain.close()
    assert (len(set(digests.values())) > 1) == (defect or not is_kernel_bound()), digests


LONG = 300
LONG_PLANS = {"random0": chunkings(LONG)["random0"], "4 uneven": chunkings(LONG)["4 uneven"], "tile edges": [127, 2, 126, 3, 42]}


@pytest.fixture(scope="module")
def long_case(real_engine, real_model):
    tokens = np.random.default_rng(11).integers(0, real_model.spec.vocab_size, LONG).tolist()
    return tokens, feed(real_engine, tokens, [LONG], SINK, 200).state_digest()


@pytest.mark.parametrize("name", sorted(LONG_PLANS))
def test_chunking_invariance_long_window(real_engine, long_case, name):
    """Window 200 over 300 tokens: key prefixes of 128, 256 and all slots are exercised."""
    tokens, ref = long_case
    assert feed(real_engine, tokens, LONG_PLANS[name], SINK, 200).state_digest() == ref
