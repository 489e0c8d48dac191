"""Fused projections and compiled block pieces: same bits as the modules they replace."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from inference_engine.model.families import FAMILIES
from inference_engine.model.forward import forward
from inference_engine.model.fused_block import apply_linear, concat_linears, fused_block, linear_arrays, linear_kind
from inference_engine.execution.kv_cache import CacheGeometry, SinkWindowKVCache
from tests.tiny_models import random_model


def _linears(bias: bool, quantized: bool) -> list[nn.Module]:
    mx.random.seed(3)
    parts = [nn.Linear(64, n, bias=bias) for n in (64, 32, 32)]
    if quantized:
        parts = [nn.QuantizedLinear.from_linear(p, group_size=32, bits=4) for p in parts]
    mx.eval([p.parameters() for p in parts])
    return parts


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_fused_linear_is_the_parts_side_by_side(bias, quantized):
    parts = _linears(bias, quantized)
    x = mx.random.normal((1, 5, 64))

    def run(p: nn.Module) -> np.ndarray:  # as the forward computes it: fp32 on the exact kernels where bound
        return np.array(apply_linear(linear_kind(p), x, linear_arrays(p)))

    before = [run(p) for p in parts]
    fused = concat_linears(parts)
    out = run(fused)
    assert np.array_equal(out, np.concatenate(before, axis=-1))  # bitwise, column by column
    if linear_kind(fused).matmul is None:  # MLX computes it: apply_linear == the module's own call
        assert np.array_equal(np.array(fused(x)), out)
    else:  # the exact product (+ bias after), the same numbers as MLX's to rounding
        assert np.allclose(np.array(fused(x)), out, rtol=1e-5, atol=1e-5)
    for p, b in zip(parts, before):  # the parts (now views of the fused arrays) still compute the same
        assert np.array_equal(run(p), b)


def test_parts_share_the_fused_memory():
    parts = [nn.Linear(512, 1024, bias=False) for _ in range(3)]  # 6 MiB of weights
    mx.eval([p.parameters() for p in parts])
    before = mx.get_active_memory()
    fused = concat_linears(parts)
    grown = mx.get_active_memory() - before
    assert fused.weight.shape == (3072, 512)
    assert grown < parts[0].weight.nbytes  # views, not a second copy (a copy would add 6 MiB)


def test_fused_block_is_built_once_and_not_a_parameter():
    tiny = random_model(seed=4)
    layer = tiny.model.model.layers[0]
    names = {k for k, _ in nn.utils.tree_flatten(tiny.model.parameters())}
    assert fused_block(layer, FAMILIES["llama"]) is fused_block(layer, FAMILIES["llama"])
    assert {k for k, _ in nn.utils.tree_flatten(tiny.model.parameters())} == names


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "mlp_bias": True}])
def test_forward_matches_mlx_lm(overrides):
    """Our forward (fused, compiled, sink-window attention) agrees with mlx-lm's own model call."""
    from mlx_lm.models.cache import make_prompt_cache

    tiny = random_model(seed=5, **overrides)
    tokens = np.random.default_rng(0).integers(0, 256, 20).tolist()
    ref = tiny.model(mx.array([tokens]), cache=make_prompt_cache(tiny.model))[0]  # (L, V)
    g = CacheGeometry(sink=4, window=64, max_block=8, max_rollback=2)
    a = tiny.model.model.layers[0].self_attn
    cache = [SinkWindowKVCache(g, a.n_kv_heads, a.q_proj.weight.shape[0] // a.n_heads) for _ in tiny.model.layers]
    ours = forward(tiny.model, tokens, cache, all_logits=True)
    assert np.allclose(np.array(ours), np.array(ref), atol=1e-4, rtol=1e-4)
    assert mx.argmax(ours, axis=-1).tolist() == mx.argmax(ref, axis=-1).tolist()
