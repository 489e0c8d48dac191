"""GGUF files served from their own blocks (model/gguf_file_blocks.py): bitwise the fp32 dequantization's model.

Tiny GGUF files of every family (tests/family_gguf.py) carry every served type, q/k/v of
mixed types included; the block-served model's logits equal the fp32-served model's bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from inference_engine.model.families import family_of_model
from inference_engine.model.fused_block import apply_linear, concat_linears, fused_block, linear_arrays, linear_kind
from inference_engine.model.gguf_blocks import Q4_0, Q5_0, Q8_0, BlockLinear, as_q8_0, dequantize_blocks, fuse_formats
from inference_engine.model.gguf_file_blocks import served_types
from inference_engine.model.loader import load_gguf_model
from inference_engine.quant_kernel import load_quant_kernel
from inference_engine.execution.tile_probe import fp32_mismatches
from tests.blas_env import linux_openblas
from tests.family_gguf import write_family_gguf
from tests.test_gguf_models import FAMILIES, _logits, _types

pytestmark = linux_openblas


@pytest.fixture(scope="module")
def qmatmul():
    kernel = load_quant_kernel()
    assert not isinstance(kernel, str), kernel
    return kernel.qmatmul


@pytest.mark.parametrize("fmt", [Q4_0, Q5_0])
def test_q8_0_form_keeps_every_weight(fmt):
    import gguf

    w = np.random.default_rng(fmt).standard_normal((7, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType(fmt))
    assert dequantize_blocks(as_q8_0(blocks, fmt), Q8_0).tobytes() == dequantize_blocks(blocks, fmt).tobytes()
    with pytest.raises(ValueError, match="no exact Q8_0 form"):
        as_q8_0(blocks, 3)


@pytest.mark.parametrize("name", FAMILIES)
def test_blocks_compute_the_fp32_models_logits(tmp_path, qmatmul, name):
    write_family_gguf(name, tmp_path / "m.gguf", _types(FAMILIES.index(name)))
    fp32 = load_gguf_model(tmp_path / "m.gguf")
    blocks = load_gguf_model(tmp_path / "m.gguf", qmatmul=qmatmul)
    assert blocks.spec.weight_formats == fp32.spec.weight_formats
    assert set(served_types(blocks.model)) == set(_types(FAMILIES.index(name)).values()) | {"F32"}
    tokens = np.random.default_rng(5).integers(0, 256, 30).tolist()
    assert _logits(blocks.model, tokens, blocks.spec).tobytes() == _logits(fp32.model, tokens, fp32.spec).tobytes()
    assert fp32_mismatches(blocks.model, rows=8) == ()  # the probe's check, over every (shape, type)


def test_mixed_types_fuse_or_stay_separate(qmatmul):
    import gguf

    rng = np.random.default_rng(9)
    x = mx.array(rng.standard_normal((1, 3, 256)).astype(np.float32))

    def linear(kind: str, rows: int) -> BlockLinear:
        w = rng.standard_normal((rows, 256)).astype(np.float32)
        return BlockLinear(mx.array(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])),
                           int(gguf.GGMLQuantizationType[kind]), 256, qmatmul)

    parts = [linear("Q5_0", 8), linear("Q4_0", 4), linear("Q8_0", 4)]
    want = mx.concatenate([p(x) for p in parts], axis=-1)
    fused = concat_linears(parts)
    assert isinstance(fused, BlockLinear) and fused.fmt == Q8_0 and {p.fmt for p in parts} == {Q8_0}
    assert np.array(fused(x)).tobytes() == np.array(want).tobytes()
    parts = [linear("Q4_1", 8), linear("Q8_0", 4)]
    assert not fuse_formats(parts)
    mixed = concat_linears(parts)  # no common form: fp32 rows of gguf-py's dequantization
    assert type(mixed) is nn.Linear and mixed.weight.shape == (12, 256)
    exact = apply_linear(linear_kind(mixed), x, linear_arrays(mixed))  # the exact fp32 kernel, as served
    assert np.array(exact).tobytes() == np.array(mx.concatenate([p(x) for p in parts], axis=-1)).tobytes()
    dense = nn.Linear(256, 4, bias=False)  # a GGUF may store a part F32: blocks beside it fuse as fp32 rows too
    parts = [linear("Q8_0", 8), dense]
    beside = concat_linears(parts)
    assert type(beside) is nn.Linear and beside.weight.shape == (12, 256)
    want = mx.concatenate([parts[0](x), apply_linear(linear_kind(dense), x, linear_arrays(dense))], axis=-1)
    assert np.array(apply_linear(linear_kind(beside), x, linear_arrays(beside))).tobytes() == np.array(want).tobytes()


def test_a_block_of_mixed_qkv_types_still_runs_natively(tmp_path, qmatmul):
    """Layer 0 of _types(1) has q Q4_1 / k Q5_0 / v Q5_1: no common form, fused as fp32 rows, native plan kept."""
    write_family_gguf("llama", tmp_path / "m.gguf", _types(1))
    loaded = load_gguf_model(tmp_path / "m.gguf", qmatmul=qmatmul)
    block = fused_block(loaded.model.model.layers[0], family_of_model(loaded.model))
    assert type(block.qkv) is nn.Linear and isinstance(block.o_proj if hasattr(block, "o_proj") else loaded.model.model.layers[0].self_attn.o_proj, BlockLinear)
    assert block.plan is not None and block.plan.ints[7] == 0  # qkv: an fp32 product


def test_probe_names_the_type_that_differs(tmp_path, qmatmul):
    """A kernel that is off by one ulp on Q4_K (a fixture, not the real kernel) is caught and named."""
    write_family_gguf("llama", tmp_path / "m.gguf", _types(0))

    def off_on_q4_k(x, blocks, fmt):
        y = qmatmul(x, blocks, fmt)
        return mx.array(np.nextafter(np.array(y), np.inf)) if fmt == 12 else y

    loaded = load_gguf_model(tmp_path / "m.gguf", qmatmul=off_on_q4_k)
    bad = fp32_mismatches(loaded.model, rows=4)
    assert len(bad) == 1 and "Q4_K" in bad[0]


def test_an_unserved_type_stops_the_block_load(tmp_path, qmatmul):
    import gguf

    write_family_gguf("llama", tmp_path / "q2.gguf", {"model.layers.1.mlp.down_proj.weight": "Q4_K"})
    data = bytearray((tmp_path / "q2.gguf").read_bytes())
    name = b"blk.1.ffn_down.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    data[at : at + 4] = int(gguf.GGMLQuantizationType.Q2_K).to_bytes(4, "little")
    (tmp_path / "q2.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tensor blk.1.ffn_down.weight has ggml type Q2_K, which is not served"):
        load_gguf_model(tmp_path / "q2.gguf", qmatmul=qmatmul)
