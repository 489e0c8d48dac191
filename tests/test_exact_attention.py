"""The native kernels (native/exact_attention.cpp, exact_layer.cpp): one node per block for every session.

Bits: a row's output depends on its position and its session's K/V only (not on the block it
came in, its companions, their layouts, or the ring's wrap); values: the softmax attention
over `CacheGeometry.visible_positions` against a float64 reference, the whole block against
the same forward as MLX ops.
"""

from __future__ import annotations

import io
import re
import sys

import mlx.core as mx
import numpy as np
import pytest

from inference_engine.model.families import FAMILIES
from inference_engine.model import native_kernels
from inference_engine.model.forward import Segment, Span, forward, forward_rows
from inference_engine.model.fused_block import fused_block
from inference_engine.quant_kernel import enable_native_kernels
from inference_engine.execution.executor import LocalBackend, LocalExecutor
from inference_engine.execution.kv_cache import CacheGeometry, SinkWindowKVCache
from tests.tiny_models import random_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel is built on Linux (CPU)")
N_KV, REP, D = 2, 3, 16


@pytest.fixture(scope="module")
def kernel() -> native_kernels.NativeKernels:
    assert enable_native_kernels() == ""  # bound at the test run's start (conftest), as in servers
    bound = native_kernels.active()
    assert bound is not None
    return bound


def rows_of(seed: int, positions: range) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (L, n_kv, rep, D), k, v (n_kv, L, D) of the given positions: fixed per (seed, position)."""
    qs, ks, vs = [], [], []
    for p in positions:
        rng = np.random.default_rng(seed * 100_003 + p)
        qs.append(rng.standard_normal((N_KV, REP, D)).astype(np.float32))
        ks.append(rng.standard_normal((N_KV, D)).astype(np.float32))
        vs.append(rng.standard_normal((N_KV, D)).astype(np.float32))
    return np.stack(qs), np.stack(ks, axis=1), np.stack(vs, axis=1)


def feed(kernel, sessions: list[tuple[int, CacheGeometry, list[int]]]) -> list[np.ndarray]:
    """Feed each session (seed, geometry, block sizes) its positions; block i of every session
    goes in one kernel call together. Returns each session's outputs, (positions, n_kv, rep, D)."""
    caches = [SinkWindowKVCache(g, N_KV, D) for _, g, _ in sessions]
    outs: list[list[np.ndarray]] = [[] for _ in sessions]
    for step in range(max(len(b) for *_, b in sessions)):
        live = [i for i, (*_, blocks) in enumerate(sessions) if step < len(blocks)]
        parts = [rows_of(sessions[i][0], range(caches[i].offset, caches[i].offset + sessions[i][2][step])) for i in live]
        q, k, v = (mx.array(np.concatenate([p[j] for p in parts], axis=0 if j == 0 else 1)) for j in range(3))
        out = np.array(native_kernels.attend(kernel, q, k, v, [caches[i] for i in live],
                                               [sessions[i][2][step] for i in live]))
        lo = 0
        for i in live:
            n = sessions[i][2][step]
            outs[i].append(out[lo : lo + n])
            lo += n
    return [np.concatenate(o) for o in outs]


def reference(seed: int, g: CacheGeometry, n: int) -> np.ndarray:
    """Softmax attention of positions 0..n-1 over their visible positions, in float64."""
    q, k, v = (a.astype(np.float64) for a in rows_of(seed, range(n)))
    out = np.zeros((n, N_KV, REP, D))
    for p in range(n):
        seen = g.visible_positions(p)
        scores = np.einsum("hrd,hsd->hrs", q[p], k[:, seen])
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[p] = np.einsum("hrs,hsd->hrd", w / w.sum(-1, keepdims=True), v[:, seen])
    return out


def test_every_chunking_gives_the_same_bits_and_the_softmax_values(kernel):
    g = CacheGeometry(sink=3, window=20, max_block=8, max_rollback=4)  # 35 slots: 90 positions wrap twice
    whole = feed(kernel, [(1, g, [8] * 11 + [2])])[0]
    for blocks in ([1] * 90, [5, 8, 1, 7, 3, 8, 8, 2, 8, 8, 8, 8, 8, 8]):
        assert np.array_equal(feed(kernel, [(1, g, blocks)])[0], whole)
    np.testing.assert_allclose(whole, reference(1, g, 90), rtol=2e-5, atol=2e-6)


def test_a_rows_bits_do_not_depend_on_its_companions(kernel):
    a = CacheGeometry(sink=4, window=30, max_block=8, max_rollback=2)
    b = CacheGeometry(sink=0, window=5, max_block=8, max_rollback=8)  # another layout in the same calls
    alone = feed(kernel, [(7, a, [8, 8, 1, 1, 1, 8, 8, 8, 8])])[0]
    together = feed(kernel, [(3, b, [2, 8, 8, 8, 8, 8, 8, 8, 1, 1, 1]), (7, a, [8, 8, 1, 1, 1, 8, 8, 8, 8]),
                             (9, a, [1, 1, 1])])
    assert np.array_equal(together[1], alone)
    np.testing.assert_allclose(together[0], reference(3, b, 61), rtol=2e-5, atol=2e-6)


def test_the_kernel_refuses_bad_arguments(kernel):
    g = CacheGeometry(sink=2, window=4, max_block=4, max_rollback=1)
    cache = SinkWindowKVCache(g, N_KV, D)
    q, k, v = (mx.array(a) for a in rows_of(0, range(2)))
    args = dict(starts=[0], rows=[2], sinks=[2], windows=[4], rings=[g.ring])
    with pytest.raises(ValueError, match="two caches"):
        kernel.attend(q, k, v, [cache.keys], **args)
    with pytest.raises(ValueError, match="add up"):
        kernel.attend(q, k, v, [cache.keys, cache.values], **{**args, "rows": [1]})
    with pytest.raises(ValueError, match="ring must hold"):
        kernel.attend(q, k, v, [cache.keys, cache.values], **{**args, "rings": [5]})
    with pytest.raises(ValueError, match="not \\(n_kv, slots, D\\)"):
        kernel.attend(q, k, v, [cache.keys[:1], cache.values[:1]], **args)
    with pytest.raises(ValueError, match="float32"):
        kernel.attend(q.astype(mx.float16), k, v, [cache.keys, cache.values], **args)
    broadcast = mx.broadcast_to(mx.array(0.0), cache.keys.shape)  # no buffer of its own to write into
    with pytest.raises(RuntimeError, match="materialized"):
        mx.eval(kernel.attend(q, k, v, [broadcast, cache.values], **args))
    with pytest.raises(ValueError, match="max_block"):
        cache.reserve(5)


def node_labels(x: mx.array) -> list[str]:
    s = io.StringIO()
    mx.export_to_dot(s, x)
    return re.findall(r'label ="([^"]+)"', s.getvalue())


def test_a_forward_is_one_node_per_block_whatever_the_sessions(kernel):
    model = random_model(seed=3).model
    g = CacheGeometry(sink=2, window=16, max_block=8, max_rollback=2)
    spec = model.args

    def graph(sessions: int) -> list[str]:
        segments = []
        for s in range(sessions):
            caches = [SinkWindowKVCache(g, spec.num_key_value_heads, spec.hidden_size // spec.num_attention_heads)
                      for _ in model.model.layers]
            forward(model, [5 + s, 6, 7], caches)
            segments.append(Segment(caches, 1, False))
        return node_labels(forward_rows(model, mx.array([9] * sessions, dtype=mx.int32), segments, Span.whole(model)))

    two, five = graph(2), graph(5)
    assert kernel.block is not None  # the test run's BLAS is the exact-gemm library (scripts/run_tests.sh)
    assert two.count("ExactLayer") == five.count("ExactLayer") == len(model.model.layers)
    assert len(five) == len(two)  # more sessions add rows, not graph nodes


def logits_of(model, tokens: list[int], blocks: list[int], g: CacheGeometry) -> np.ndarray:
    spec = model.args
    caches = [SinkWindowKVCache(g, spec.num_key_value_heads, spec.hidden_size // spec.num_attention_heads)
              for _ in model.model.layers]
    out, lo = [], 0
    for n in blocks:
        out.append(np.array(forward(model, tokens[lo : lo + n], caches)))
        lo += n
    return np.concatenate(out)


def test_the_native_block_computes_the_mlx_block(kernel, monkeypatch):
    model = random_model(seed=5).model
    g = CacheGeometry(sink=2, window=12, max_block=8, max_rollback=2)  # 24 slots: 40 tokens wrap
    tokens = [(7 * i + 3) % 256 for i in range(40)]
    native = logits_of(model, tokens, [8] * 5, g)
    assert np.array_equal(logits_of(model, tokens, [1] * 13 + [8, 8, 3, 8], g), native)
    monkeypatch.setattr(native_kernels, "_bound", None)  # the same forward as MLX ops
    np.testing.assert_allclose(native, logits_of(model, tokens, [8] * 5, g), rtol=1e-4, atol=1e-4)


def test_a_block_the_native_kernel_does_not_compute_keeps_mlx_pieces(kernel):
    biased = random_model(seed=6, attention_bias=True).model  # linears with a bias: no plan
    g = CacheGeometry(sink=2, window=12, max_block=8, max_rollback=2)
    assert fused_block(biased.model.layers[0], FAMILIES["llama"]).plan is None
    spec = biased.args
    caches = [SinkWindowKVCache(g, spec.num_key_value_heads, spec.hidden_size // spec.num_attention_heads)
              for _ in biased.model.layers]
    labels = node_labels(forward_rows(biased, mx.array([1, 2], dtype=mx.int32), [Segment(caches, 2, True)],
                                      Span.whole(biased)))
    assert "ExactLayer" not in labels and labels.count("ExactAttention") == len(biased.model.layers)


def test_the_block_kernel_refuses_bad_arguments(kernel):
    model = random_model(seed=3).model
    plan = fused_block(model.model.layers[0], FAMILIES["llama"]).plan
    g = CacheGeometry(sink=2, window=12, max_block=8, max_rollback=2)
    spec = model.args
    cache = SinkWindowKVCache(g, spec.num_key_value_heads, spec.hidden_size // spec.num_attention_heads)
    h = mx.zeros((1, 2, spec.hidden_size))
    segs = ([0], [2], [2], [12], [g.ring])
    cases = [
        ((h, list(plan.weights[:5]), [cache.keys, cache.values], list(plan.ints), list(plan.floats), *segs), "six"),
        ((h[:, :, :8], list(plan.weights), [cache.keys, cache.values], list(plan.ints), list(plan.floats), *segs),
         "h must be"),
        ((h, list(plan.weights), [cache.keys], list(plan.ints), list(plan.floats), *segs), "two caches"),
        ((h, list(plan.weights), [cache.keys, cache.values], list(plan.ints)[:-1], list(plan.floats), *segs),
         "11 ints"),
        ((h, list(plan.weights), [cache.keys, cache.values], list(plan.ints), list(plan.floats), [0], [1], *segs[2:]),
         "add up"),
        ((h, list(plan.weights), [cache.keys, cache.values], list(plan.ints), list(plan.floats), *segs[:4], []),
         "one start, row count"),  # a short list was read past its end
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            kernel.block(*args)


def test_a_snapshot_survives_the_in_place_writes_that_follow(kernel):
    loaded = random_model(seed=4)
    backend = LocalBackend(loaded.model, loaded.spec, max_block=8)
    g = CacheGeometry(sink=2, window=10, max_block=8, max_rollback=2)
    executor = LocalExecutor(backend, g)
    first = forward(loaded.model, list(range(1, 15)), executor.cache)
    before = [c.digest() for c in executor.cache]
    kept = executor.snapshot()
    forward(loaded.model, list(range(30, 54)), executor.cache)  # wraps the 22-slot ring: every slot rewritten
    assert [c.digest() for c in executor.cache] != before
    executor.restore(kept)
    assert [c.digest() for c in executor.cache] == before
    again = forward(loaded.model, [15], executor.cache)
    fresh = LocalExecutor(backend, g)
    assert np.array_equal(np.array(forward(loaded.model, list(range(1, 16)), fresh.cache)[-1]), np.array(again[-1]))
    assert first.shape[0] == 14


def cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def mixed_batch(kernel, seed: int, g: CacheGeometry, offsets: list[int], rows: list[int], d: int):
    """A batch of sessions at `offsets` (random stored K/V) each adding `rows` rows; returns a
    function computing its attention afresh (new caches each time), as bytes."""
    rng = np.random.default_rng(seed)
    r = sum(rows)
    q = mx.array((rng.standard_normal((r, N_KV, REP, d)) * 3).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((N_KV, r, d)).astype(np.float32)) for _ in range(2))
    stored = [(rng.standard_normal((N_KV, g.slots, d)).astype(np.float32),
               rng.standard_normal((N_KV, g.slots, d)).astype(np.float32)) for _ in offsets]

    def attend() -> bytes:
        caches = [SinkWindowKVCache(g, N_KV, d) for _ in offsets]
        for c, offset, (ks, vs) in zip(caches, offsets, stored):
            c.keys, c.values, c.offset = mx.array(ks), mx.array(vs), offset
            mx.eval(c.keys, c.values)
        return np.array(native_kernels.attend(kernel, q, k, v, caches, rows)).tobytes()

    return attend


@pytest.mark.parametrize("d", [64, 12, 72])
def test_avx2_attention_and_silu_are_the_portable_bits(kernel, d) -> None:
    """The 8-lane AVX2 variants (attention, and the SiLU inside the block) against the portable
    code on one batch: sessions of 1, 2 and 7 rows (odd key counts, a wrapped ring), head dims
    with and without a remainder of 8 (the servers' is 64), then a native block forward."""
    from inference_engine.quant_kernel import _import, extension_path

    module = _import(extension_path())
    attend = mixed_batch(kernel, d, CacheGeometry(sink=2, window=9, max_block=8, max_rollback=2), [0, 23, 5], [1, 2, 7], d)
    model = random_model(seed=3)

    def block_logits() -> bytes:
        executor = LocalExecutor(LocalBackend(model.model, model.spec, max_block=64),
                                 CacheGeometry(sink=4, window=32, max_block=64, max_rollback=4))
        return np.array(forward(model.model, list(range(1, 40)), executor.cache)).tobytes()

    previous = module.set_avx2(True)
    try:
        assert previous == cpu_has_avx2()  # on by default wherever the CPU has it
        wide = attend(), block_logits()
        module.set_avx2(False)
        portable = attend(), block_logits()
    finally:
        module.set_avx2(previous)
    assert wide[0] == portable[0]
    assert wide[1] == portable[1]


def test_attention_on_the_kernel_pool_is_the_per_call_threads_bits(kernel) -> None:
    """Attention's (row, KV head) items on exact-gemm's pool (the default once bound) against
    threads started per call, on a batch big enough to be shared out: sessions of 16, 3, 1
    and 9 rows with up to 305 visible keys, one of them wrapped."""
    from inference_engine.quant_kernel import _import, extension_path

    module = _import(extension_path())
    g = CacheGeometry(sink=4, window=300, max_block=16, max_rollback=2)
    attend = mixed_batch(kernel, 11, g, [0, 150, 400, 301], [16, 3, 1, 9], D)

    previous = module.set_attention_pool(True)
    try:
        assert previous  # bound with the kernel library, on by default
        pooled = attend()
        module.set_attention_pool(False)
        per_call = attend()
    finally:
        module.set_attention_pool(previous)
    assert pooled == per_call
    assert np.isfinite(np.frombuffer(pooled, dtype=np.float32)).all()
