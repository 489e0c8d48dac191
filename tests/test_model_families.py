"""Every family we serve, as a tiny random-weight mlx-lm folder: INV-3 bitwise, and mlx-lm's own greedy tokens.

The battery (chunkings across the window's wrap, rollback after the wrap, fork/restore, and
batched streams with companions incl. prompt lookup through a real server) runs on each
family's folder loaded by our loader; greedy decoding is compared with mlx-lm's own model
and caches over the same folder for 32 steps. Gemma 3's tiny model alternates a local layer
(window 8) and a global one, so both kinds wrap, roll back and fork.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from inference_engine.model.families import FAMILIES, family_of
from inference_engine.model.forward import Segment, Span, forward_rows
from inference_engine.model.loader import load_model
from inference_engine.runtime.engine import Engine
from inference_engine.session.coordinator import SessionCoordinator
from inference_engine.v1 import runtime_pb2 as pb
from tests.coordinator_helpers import append_alone
from tests.exactness import chunkings, feed
from tests.family_models import FAMILY_CONFIGS, save_family_model
from tests.kernel_guard import assert_full_tile
from tests.test_batching import GREEDY, LOOKUP, Scenario, assert_batch_invariant

SINK, WINDOW, N = 2, 12, 60  # 2 + 12 + 16 + 9 = 39 slots: 60 tokens wrap the ring
NAMES = sorted(FAMILY_CONFIGS)


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory):
    """(name, loaded model, exact engine, folder) of one family's tiny model."""
    folder = save_family_model(request.param, tmp_path_factory.mktemp(request.param))
    loaded = load_model(folder)
    engine = assert_full_tile(Engine(loaded, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield request.param, loaded, engine, folder
    engine.close()


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 256, n).tolist()


def test_spec_reads_the_family(family):
    name, loaded, _, _ = family
    spec = loaded.spec
    assert spec.family == FAMILY_CONFIGS[name]["model_type"] and spec.head_dim == 16
    if name == "gemma3_text":
        assert spec.layer_windows == (8, None)  # local, global
    else:
        assert spec.layer_windows == ()


@pytest.mark.parametrize("plan", ["Nx1", "pairs", "4 uneven", "random0", "random1", "straddle"])
def test_chunking_invariance_across_the_wrap(family, plan):
    _, _, engine, _ = family
    tokens = _tokens(1, N)
    sizes = {**chunkings(N), "straddle": [13, 9, 16, 22]}[plan]
    ref = feed(engine, tokens, [N], SINK, WINDOW)
    v = feed(engine, tokens, sizes, SINK, WINDOW)
    assert v.cached_token_sequence == tokens[:SINK] + tokens[-WINDOW:]
    assert np.array(v.next_token_logits).tobytes() == np.array(ref.next_token_logits).tobytes()
    assert v.state_digest() == ref.state_digest()


@pytest.mark.parametrize("fed,block,accepted", [(40, 8, 0), (45, 8, 3), (50, 5, 5)])
def test_rollback_after_the_wrap(family, fed, block, accepted):
    _, _, engine, _ = family
    tokens = _tokens(2, N)
    v = feed(engine, tokens, [fed], SINK, WINDOW)
    drafted = list(reversed(tokens[fed : fed + block]))
    v.forward_block(drafted)
    v.commit_or_truncate(block, accepted)
    assert v.state_digest() == feed(engine, tokens[:fed] + drafted[:accepted], [fed + accepted], SINK, WINDOW).state_digest()
    rest = tokens[fed : fed + 6]
    v.forward_block(rest)
    v.commit_or_truncate(len(rest), len(rest))
    whole = tokens[:fed] + drafted[:accepted] + rest
    assert v.state_digest() == feed(engine, whole, [len(whole)], SINK, WINDOW).state_digest()


def test_fork_restore_continues_bitwise(family):
    _, _, engine, _ = family
    tokens = _tokens(3, N)
    a = engine.open_session(SINK, WINDOW)
    append_alone(a, tokens[:45])
    log, logits, kv = a.export_state()
    b = SessionCoordinator.from_state(engine.backend, engine.geometry(SINK, WINDOW), log, logits, kv)
    assert b.state_digest() == a.state_digest()
    for c in (a, b):
        append_alone(c, tokens[45:])
    assert b.state_digest() == a.state_digest()
    a.close()
    b.close()


def test_rows_batched_with_companions_keep_their_bits(family):
    _, loaded, engine, _ = family
    model, spec = loaded.model, loaded.spec
    ours, others = _tokens(4, 7), [_tokens(5, 3), _tokens(6, 5)]

    def caches(prefix: list[int]) -> list:
        v = engine.make_verifier(SINK, WINDOW)
        if prefix:
            v.prefill(prefix)
        return v.executor.cache

    alone = forward_rows(model, mx.array(ours, dtype=mx.int32), [Segment(caches(_tokens(7, 20)), 7, True)],
                         Span.whole(model))
    segs = [Segment(caches(_tokens(8, 30)), 3, True), Segment(caches(_tokens(7, 20)), 7, True),
            Segment(caches([]), 5, False)]
    x = mx.array(others[0] + ours + others[1], dtype=mx.int32)
    together = forward_rows(model, x, segs, Span.whole(model))
    assert spec.num_layers == 2
    assert np.array(together[3:10]).tobytes() == np.array(alone).tobytes()


async def test_streams_through_the_server_are_batch_invariant(family):
    _, _, engine, _ = family
    loop = tuple(_tokens(9, 6)) * 4  # prompt lookup finds matches
    scenarios = [
        Scenario(2, 8, tuple(_tokens(10, 12)), (("gen", 24, GREEDY, 1),)),
        Scenario(3, 16, loop, (("gen", 12, LOOKUP, 4), ("append", tuple(_tokens(11, 20))), ("gen", 6, GREEDY, 1)),
                 0.01),
    ]
    assert await assert_batch_invariant(engine, scenarios) >= 2


def test_greedy_tokens_equal_mlx_lm_for_32_steps(family):
    """mlx-lm's own model and caches on the same folder: the same 32 greedy tokens."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_lm_load

    _, _, engine, folder = family
    ref_model, _ = mlx_lm_load(folder)
    prompt = _tokens(12, 6)
    cache = make_prompt_cache(ref_model)
    logits = ref_model(mx.array([prompt]), cache=cache)[0, -1]
    theirs = []
    for _ in range(32):
        theirs.append(int(mx.argmax(logits).item()))
        logits = ref_model(mx.array([[theirs[-1]]]), cache=cache)[0, -1]
    v = engine.make_verifier(4, 64)  # the window holds the whole sequence: no approximation
    v.prefill(prompt)
    ours = []
    for _ in range(32):
        ours.append(int(mx.argmax(v.next_token_logits).item()))
        v.forward_block([ours[-1]])
        v.commit_or_truncate(1, 1)
    assert ours == theirs


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="gemma3_text, llama, mistral, qwen2, qwen3"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        family_of("phi3")
    assert set(FAMILIES) == {c["model_type"] for c in FAMILY_CONFIGS.values()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the native block is built on Linux (CPU)")
def test_every_family_runs_as_one_native_node_per_block_close_to_mlx_ops(family, monkeypatch):
    """The native block computes every family's additions (bias, q/k norms, sandwich norms, GELU, RoPE tables):
    one ExactLayer node per block, and logits within float rounding of the same forward as MLX ops."""
    from inference_engine.model import native_kernels
    from tests.test_exact_attention import node_labels

    name, loaded, engine, _ = family
    model = loaded.model
    assert native_kernels.active() is not None and native_kernels.active().block is not None
    tokens = _tokens(13, 12)

    def logits() -> mx.array:
        v = engine.make_verifier(SINK, WINDOW)
        return forward_rows(model, mx.array(tokens, dtype=mx.int32), [Segment(v.executor.cache, 12, True)],
                            Span.whole(model))

    native = logits()
    assert node_labels(native).count("ExactLayer") == loaded.spec.num_layers, name
    monkeypatch.setattr(native_kernels, "_bound", None)  # the same forward as MLX ops
    np.testing.assert_allclose(np.array(native), np.array(logits()), rtol=2e-4, atol=2e-4)
