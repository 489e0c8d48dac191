"""Small units of the family seam: adapters, the GGUF header reader, sliding caches, a logit soft-cap."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from inference_engine.model import families
from inference_engine.model.families.base import Family
from inference_engine.model.forward import forward
from inference_engine.model.gguf_model import check_tensor_types
from inference_engine.model.gguf_reader import read_gguf
from inference_engine.execution.kv_cache import CacheGeometry
from inference_engine.execution.sliding_kv_cache import SlidingKVCache, layer_cache, layer_geometry
from tests.family_gguf import write_family_gguf
from tests.tiny_models import random_model


def test_a_family_refuses_an_unknown_activation():
    with pytest.raises(ValueError, match="activation 'relu' is not one of"):
        Family(model_type="x", activation="relu")


def test_the_reader_refuses_foreign_and_truncated_files_and_names_unknown_types(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="is not a GGUF v2"):
        read_gguf(tmp_path / "x.gguf")
    write_family_gguf("llama", tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(tmp_path / "short.gguf")
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    forged = bytearray(data)
    forged[at : at + 4] = (99).to_bytes(4, "little")  # a ggml type nobody knows
    (tmp_path / "forged.gguf").write_bytes(bytes(forged))
    g = read_gguf(tmp_path / "forged.gguf")
    with pytest.raises(ValueError, match="tensor blk.0.attn_q.weight has ggml type type 99"):
        check_tensor_types(g)


def test_a_sliding_cache_keeps_its_window_in_the_sessions_layout():
    g = CacheGeometry(sink=2, window=6, max_block=4, max_rollback=2)
    assert layer_geometry(g, None) is g
    assert layer_geometry(g, 4) == dataclasses.replace(g, sink=0, window=3)  # itself + 3 before
    assert layer_geometry(g, 100).window == 6  # never more than the session's window
    c = SlidingKVCache(g, 4, 1, 2)
    c.update_and_fetch(mx.ones((1, 4, 2)),
                       mx.ones((1, 4, 2)))
    c.update_and_fetch(2 * mx.ones((1, 4, 2)), 2 * mx.ones((1, 4, 2)))
    assert c.retained_positions() == [0, 1, 2, 3, 4, 5, 6, 7]  # the session's sinks and window
    k, _ = c.canonical_state()
    assert np.array(k)[0, :, 0].tolist() == [0, 0, 0, 0, 0, 2, 2, 2]  # it keeps the last 3 only
    fresh = SlidingKVCache(g, 4, 1, 2)
    with pytest.raises(ValueError, match="do not fit a cache at position 8"):
        fresh.load_canonical(8, np.zeros((1, 3, 2), np.float32), np.zeros((1, 3, 2), np.float32))
    fresh.load_canonical(8, np.array(k), np.array(k))
    assert fresh.digest() == c.digest()
    with pytest.raises(ValueError, match="fresh cache only"):
        fresh.load_canonical(8, np.array(k), np.array(k))


def test_a_logit_soft_cap_bounds_the_logits(monkeypatch):
    tiny = random_model(seed=9)
    spec = tiny.spec
    g = CacheGeometry(sink=2, window=8, max_block=8, max_rollback=2)

    def logits() -> np.ndarray:
        return np.array(forward(tiny.model, [3, 4, 5], [layer_cache(g, spec, i) for i in range(spec.num_layers)]))

    plain = logits()
    capped_family = dataclasses.replace(families.FAMILIES["llama"], logit_softcap_arg="final_logit_softcapping")
    monkeypatch.setitem(families.FAMILIES, "llama", capped_family)
    monkeypatch.setattr(tiny.model.args, "final_logit_softcapping", 2.0, raising=False)
    capped = logits()
    assert np.abs(capped).max() <= 2.0 < np.abs(plain).max()
    np.testing.assert_allclose(capped, np.tanh(plain / 2.0) * 2.0, rtol=1e-5, atol=1e-5)


def test_a_bf16_folder_is_served_as_its_exact_fp32_widening(tmp_path, caplog):
    """A bf16 mlx-lm folder (as most are published) loads as fp32 and serves exactly: the logits of the fp32
    folder of the same weights, bit for bit (the native block takes fp32 only)."""
    from mlx.utils import tree_flatten

    from inference_engine.model.loader import load_model
    from inference_engine.runtime.engine import Engine
    from tests.exactness import feed
    from tests.family_models import save_family_model

    bf16, fp32 = save_family_model("llama", tmp_path / "bf16"), save_family_model("llama", tmp_path / "fp32")
    stored = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(bf16 / "model.safetensors")).items()}
    mx.save_safetensors(str(bf16 / "model.safetensors"), stored)
    mx.save_safetensors(str(fp32 / "model.safetensors"), {k: v.astype(mx.float32) for k, v in stored.items()})
    with caplog.at_level("INFO", logger="inference_engine"):
        loaded = load_model(bf16)
    params = dict(tree_flatten(loaded.model.parameters()))
    assert {v.dtype for v in params.values()} == {mx.float32}
    assert all(mx.array_equal(params[k], v.astype(mx.float32)).item() for k, v in stored.items())
    assert "bf16: bfloat16 weights served as fp32 (widened exactly" in caplog.text
    tokens = list(range(2, 30))
    logits = []
    for model in (loaded, load_model(fp32)):
        engine = Engine(model, exact=True, max_tile=16, plain_block=64, max_rollback=8)
        try:
            logits.append(np.array(feed(engine, tokens, [11, 17], 2, 12).next_token_logits).tobytes())
        finally:
            engine.close()
    assert logits[0] == logits[1]
