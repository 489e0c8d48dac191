"""--weights q4_1 gives the bits of --weights fp32 on the packaged model.

The q4_1 engine (the GGUF's blocks through the exact q4 kernel, built as the server builds it)
is compared with fp32 engines: the INV-3 chunkings (state digests), sessions batched
together with greedy, prompt-lookup and draft-model generation against the same scenarios
run alone on fp32, the speculative gates, and a route of three `shard-worker --weights q4_1`
processes against the fp32 single process.
"""

import asyncio
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from inference_engine.client import spec_gates as spec_gate
from inference_engine.model.gguf_blocks import BlockEmbedding, has_blocks
from inference_engine.runtime.engine import Engine
from inference_engine.server.server import build_engine, engine_weights
from inference_engine.shard.client.pipeline import ShardPipeline
from inference_engine.verifier.sink_window_verifier import state_digest
from inference_engine.v1 import runtime_pb2 as pb
from tests.blas_env import linux_openblas
from tests.conftest import make_config, running_server
from tests.exactness import feed
from tests.kernel_guard import assert_full_tile
from tests.shard_helpers import ref_block, reference, running_workers, spawn_worker
from tests.batching_helpers import DRAFT, GREEDY, LOOKUP, Scenario, play, random_tokens
from tests.test_exact_real_model import CHUNKINGS, N, SINK, WINDOW

pytestmark = [pytest.mark.real_model, linux_openblas]
SMOLLM2_SHAPES = ((576, 192), (576, 576), (576, 960), (576, 1536), (576, 3072), (576, 49152), (1536, 576))


@pytest.fixture(scope="module")
def q4_engine():
    """The server's own engine for --weights q4_1 (probed to 64 rows, the packaged draft shared)."""
    e = build_engine(make_config(weights="q4_1", max_tile=64))
    yield e
    e.close()


@pytest.fixture(scope="module")
def fp32_engine(real_model, real_model_path):
    """fp32 with the packaged MLX-quantized draft, at the same tile (the cache geometry is part of the bits)."""
    from inference_engine.model.loader import load_model

    e = assert_full_tile(Engine(real_model, exact=True, max_tile=64, plain_block=64, max_rollback=8,
                                draft=load_model(real_model_path.parent / "q4")))
    yield e
    e.close()


def test_q4_1_engine_serves_blocks_proven_equal(q4_engine):
    assert engine_weights(q4_engine) == "q4_1" and has_blocks(q4_engine.loaded.model)
    assert isinstance(q4_engine.loaded.model.model.embed_tokens, BlockEmbedding)
    probe = q4_engine.probe
    assert probe.tile == 64 and probe.failures == () and probe.is_fp32_equal
    assert probe.block_shapes == SMOLLM2_SHAPES  # every linear shape, fused ones and the LM head
    assert q4_engine.draft is q4_engine.loaded  # the packaged draft is the same Q4 blocks: no second copy


@pytest.fixture(scope="module")
def tokens(real_model):
    return np.random.default_rng(7).integers(0, real_model.spec.vocab_size, N).tolist()


@pytest.fixture(scope="module")
def fp32_digest(fp32_engine, tokens):
    return feed(fp32_engine, tokens, [N], SINK, WINDOW).state_digest()


SMALL_BATTERY = ("1xN", "Nx1", "random0", "straddle wrap", "tile edges", "64-row edges", "past 64")


@pytest.mark.parametrize("name", SMALL_BATTERY)
def test_inv3_chunkings_give_the_fp32_digest(q4_engine, tokens, fp32_digest, name):
    assert feed(q4_engine, tokens, CHUNKINGS[name], SINK, WINDOW).state_digest() == fp32_digest


async def test_batched_q4_1_sessions_are_the_fp32_solo_ones(q4_engine, fp32_engine, real_model):
    """Streams and digests after every step: q4_1, sessions batched, == fp32, each session alone."""
    v = real_model.spec.vocab_size
    copy = random_tokens(21, 10, v) * 3
    scenarios = [
        Scenario(4, 32, random_tokens(20, 30, v),
                 (("gen", 20, GREEDY, 1), ("append", random_tokens(22, 12, v)), ("gen", 6, GREEDY, 1))),
        Scenario(4, 48, copy, (("gen", 16, LOOKUP, 4),), 0.2),
        Scenario(2, 40, random_tokens(23, 50, v), (("gen", 12, DRAFT, 4),), 0.4),
    ]
    async with running_server(fp32_engine, max_sessions=3) as (stub, _):
        solo = [await play(stub, Scenario(s.sink, s.window, s.prompt, s.steps)) for s in scenarios]
    seen = []

    def observe(rows: int, sessions: int, seconds: float) -> None:
        seen.append(sessions)

    q4_engine.scheduler.observers.append(observe)
    try:
        async with running_server(q4_engine, max_sessions=3) as (stub, _):
            together = await asyncio.gather(*(play(stub, s) for s in scenarios))
    finally:
        q4_engine.scheduler.observers.remove(observe)
    assert max(seen) >= 2  # rows of several sessions shared forwards
    for i, (a, b) in enumerate(zip(solo, together)):
        assert a == b, f"scenario {i}: q4_1 batched differs from fp32 alone"


async def test_speculative_gates_on_q4_1(q4_engine, fp32_engine, real_model):
    """The gate battery (draft model, K=4, window wraps) on q4_1, whose greedy arm is fp32's stream.

    The draft is the target's own blocks (build_engine shares them); prompt lookup on q4_1 is
    compared with fp32 in the batched test above.
    """
    tok = real_model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": spec_gate.PROMPT_TEXT}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    greedy = Scenario(4, 32, prompt, (("gen", 16, GREEDY, 1),))
    async with running_server(fp32_engine) as (stub, _):
        fp32_greedy = await play(stub, greedy)
    async with running_server(q4_engine) as (stub, runtime):
        assert await play(stub, greedy) == fp32_greedy
        report = await spec_gate.run_gates(stub, pb, lambda sid: runtime.store.get(sid).history, prompt,
                                           ["draft"], [4], 16, 4, 32)
    assert report.failures == 0, "\n".join(report.lines)


async def test_three_q4_1_workers_route_is_the_fp32_single_process(real_model):
    """Logits of every block, layer digests and state digest: q4_1 workers == fp32 in one process."""
    procs = [spawn_worker(r, "--weights", "q4_1", "--block", "16", rollback=8, stderr=subprocess.PIPE)
             for r in ("0:10", "10:20", "20:30")]
    tokens = np.random.default_rng(5).integers(0, real_model.spec.vocab_size, 80).tolist()
    with running_workers(procs) as (_, addresses):
        async with ShardPipeline(addresses) as route:
            geometry = await route.open("q4", 4, 24, max_block=16)
            ref, position = reference(real_model, geometry), 0
            # a prefill, decode rows, a block past the tile's edge, a draft of 8 keeping 3 after the wrap
            for n, keep in [(20, None), (1, None), (13, None), (16, None), (8, 3), (1, None), (12, None)]:
                block = tokens[position : position + n]
                got = await route.forward("q4", block, all_logits=position > 0)
                want = ref_block(ref, block, position > 0, keep=keep)
                assert got.tobytes() == want.tobytes(), (position, n)
                if keep is not None:
                    assert await route.trim("q4", n - keep) == position + keep
                position += n if keep is None else keep
            assert position > 4 + 24 + 16 + 8  # the ring wrapped
            digests = await route.layer_digests("q4")
            assert digests == ref.executor.layer_digests()
            assert state_digest(mx.array(got[-1]), ref.cached_token_sequence, position, digests) == ref.state_digest()
        for p in procs:
            p.kill()
        logs = [p.communicate()[1] for p in procs]
    assert all("weights q4_1" in log for log in logs), logs
