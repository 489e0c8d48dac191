"""Gemma-3-270M (packaged:gemma3-270m, its Q4_K_M GGUF) end to end over gRPC: INV-3 and batched streams bitwise.

Sink 4 + window 32 over 80 tokens: the global layers' ring wraps, and the local layers
(window 512) are bounded by the session's window, so they wrap too.
"""

from __future__ import annotations

import numpy as np
import pytest

from inference_engine.config import default_cache_dir
from inference_engine.model.packaged import GEMMA_MODEL
from inference_engine.runtime.engine import Engine
from inference_engine.served_model import load_served_model
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.kernel_guard import assert_full_tile
from tests.test_batching import GREEDY, LOOKUP, Scenario, assert_batch_invariant

pytestmark = pytest.mark.real_model
SINK, WINDOW, N = 4, 32, 80


@pytest.fixture(scope="module")
def gemma():
    served = load_served_model(GEMMA_MODEL, "q4_1", default_cache_dir())
    e = assert_full_tile(Engine(served.loaded, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield e
    e.close()


async def test_chunkings_and_streams_agree_over_grpc(gemma):
    tokens = np.random.default_rng(3).integers(0, gemma.spec.vocab_size, N).tolist()
    async with running_server(gemma) as (stub, _):
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.family == "gemma3_text" and {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= set(info.weight_formats)
        assert list(info.layer_attention) == (["sliding:512"] * 5 + ["global"]) * 3
        sids = []
        for plan in ([N], [13, 1, 30, 2, 34]):
            sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
            i = 0
            for n in plan:
                await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=tokens[i : i + n]))
                i += n
            sids.append(sid)
        digests = [(await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=s))).state_digest for s in sids]
        assert digests[0] == digests[1]
        streams = []
        for sid in sids:
            got = []
            async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=6, ignore_eos=True)):
                got += list(msg.tokens)
            streams.append(got)
        assert streams[0] == streams[1] and len(streams[0]) == 6


async def test_batched_streams_are_bitwise_solo(gemma):
    v = gemma.spec.vocab_size
    rng = np.random.default_rng(4)
    loop = tuple(int(t) for t in rng.integers(0, v, 5)) * 3
    scenarios = [
        Scenario(SINK, WINDOW, tuple(int(t) for t in rng.integers(0, v, 40)), (("gen", 6, GREEDY, 1),)),
        Scenario(2, 16, loop, (("gen", 6, LOOKUP, 3),), 0.01),
    ]
    assert await assert_batch_invariant(gemma, scenarios) >= 2


def test_blocks_and_fp32_dequantization_give_the_same_digests(gemma):
    """The GGUF's own Q4_K/Q5_0/Q6_K/Q8_0 blocks (the fixture) against gguf-py's fp32 dequantization of them."""
    from inference_engine.model.gguf_blocks import has_blocks
    from tests.exactness import feed

    assert has_blocks(gemma.loaded.model)
    fp32 = load_served_model(GEMMA_MODEL, "fp32", default_cache_dir())
    e = Engine(fp32.loaded, exact=True, max_tile=16, plain_block=64, max_rollback=8)
    try:
        tokens = np.random.default_rng(5).integers(0, gemma.spec.vocab_size, 24).tolist()
        assert not has_blocks(e.loaded.model)
        assert feed(e, tokens, [24], SINK, WINDOW).state_digest() == feed(gemma, tokens, [9, 15], SINK, WINDOW).state_digest()
    finally:
        e.close()


async def test_a_sessions_first_text_starts_with_the_files_bos(gemma):
    """The GGUF says add_bos_token: a session's first text (and Tokenize with add_special_tokens) starts with
    <bos> (2), as llama.cpp starts it; later texts do not (without it the base model answers "The The The")."""
    async with running_server(gemma) as (stub, _):
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        first = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, text="The capital of France is"))
        later = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, text=" Paris"))
        assert first.tokens[0] == 2 and 2 not in later.tokens
        plain = (await stub.Tokenize(pb.TokenizeRequest(text="The capital of France is"))).tokens
        special = (await stub.Tokenize(pb.TokenizeRequest(text="The capital of France is", add_special_tokens=True)))
        assert list(special.tokens) == [2, *plain] == list(first.tokens)


async def test_the_cli_sends_a_base_model_plain_text(gemma):
    """chat and a templated generate cannot run on a model without a chat template: refused before the first
    turn (exit 2) naming `generate --raw`, which then answers the text (its BOS first: a sensible reply)."""
    import asyncio
    import io

    from inference_engine.client import cli
    from inference_engine.server.server import start_server
    from inference_engine.runtime.runtime import Runtime
    from tests.conftest import make_config

    runtime = Runtime(gemma, make_config())
    server, port = await start_server(runtime, "127.0.0.1", 0)
    try:
        async def run(*argv: str) -> tuple[int, str, str]:
            out, err = io.StringIO(), io.StringIO()
            rc = await asyncio.to_thread(cli.main, [*argv, "--target", f"127.0.0.1:{port}"], out, err,
                                         lambda prompt: "hi")
            return rc, out.getvalue(), err.getvalue()

        for argv in (["chat"], ["generate", "--prompt", "hi"]):
            rc, out, err = await run(*argv)
            assert rc == 2 and "has no chat template (a base model)" in err and "generate --raw" in err, err
        rc, out, _ = await run("generate", "--raw", "--prompt", "The capital of France is", "--max-new-tokens", "8")
        assert rc == 0 and "The The" not in out and len(set(out.split())) >= 4, out  # no BOS: "France. The The The"
        assert runtime.store.slabs_in_use == 0
    finally:
        await server.stop(0.5)
        await runtime.stop()
