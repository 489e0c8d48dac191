"""`serve --model FILE.gguf`: every family and every served ggml type, from the file alone.

Tiny GGUFs are written by gguf-py (tests/family_gguf.py), so no big file is needed:
- each parameter the loader builds is bitwise gguf-py's fp32 dequantization of its tensor
  (Q/K rows un-permuted for llama), for all eleven served types;
- a GGUF holding the folder model's own float tensors computes bitwise the folder's logits
  (config, names, permutation, `1 + w` norms, tied head, sliding layers all read right);
- the INV-3 chunking battery holds on a quantized GGUF model;
- an unserved tensor type or architecture stops the load, naming it.
"""

from __future__ import annotations

import mlx.nn as nn
import numpy as np
import pytest

from inference_engine.config import default_cache_dir
from inference_engine.model.forward import forward
from inference_engine.model.gguf_model import SUPPORTED_TYPES
from inference_engine.model.loader import load_gguf_model
from inference_engine.runtime.engine import Engine
from inference_engine.served_model import load_served_model
from inference_engine.execution.kv_cache import CacheGeometry
from inference_engine.execution.sliding_kv_cache import layer_cache
from tests.exactness import chunkings, feed
from tests.family_gguf import write_family_gguf
from tests.family_models import FAMILY_CONFIGS
from tests.kernel_guard import assert_full_tile
from tests.tiny_models import TINY_ARGS, random_model

FAMILIES = ["gemma3_text", "llama", "qwen2", "qwen3"]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj"]
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16"]


def _types(offset: int) -> dict[str, str]:
    """Every legacy/float type on some linear, and the three K-quants on the down projections (in 256)."""
    out = {f"model.layers.{layer}.{name}.weight": LEGACY[(offset + 6 * layer + i) % len(LEGACY)]
           for layer in range(2) for i, name in enumerate(LINEARS)}
    k = ["Q4_K", "Q5_K", "Q6_K"]
    out.update({f"model.layers.{layer}.mlp.down_proj.weight": k[(offset + layer) % 3] for layer in range(2)})
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_every_served_type_is_gguf_py_dequantization(tmp_path, name):
    offset = FAMILIES.index(name)
    expected = write_family_gguf(name, tmp_path / "m.gguf", _types(offset))
    loaded = load_gguf_model(tmp_path / "m.gguf")
    got = dict(nn.utils.tree_flatten(loaded.model.parameters()))
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        assert np.array(got[key]).tobytes() == want.tobytes(), key
    assert loaded.spec.family == name.replace("llama3", "llama") and loaded.tokenizer is not None
    assert loaded.tokenizer.convert_ids_to_tokens([2]) == ["ab"] and loaded.spec.eos_token_ids == (255,)


def test_all_served_types_appear_in_the_battery():
    used = {t for offset in range(len(FAMILIES)) for t in _types(offset).values()}
    assert used | {"F32"} == set(SUPPORTED_TYPES)


def _logits(model, tokens: list[int], spec) -> np.ndarray:
    g = CacheGeometry(sink=2, window=12, max_block=16, max_rollback=9)
    caches = [layer_cache(g, spec, i) for i in range(spec.num_layers)]
    return np.array(forward(model, tokens, caches, all_logits=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_a_float_gguf_computes_its_folder_bitwise(tmp_path, name):
    write_family_gguf(name, tmp_path / "m.gguf")  # F32 tensors: the model's own weights (norms as llama.cpp stores them)
    cfg = {**TINY_ARGS, **FAMILY_CONFIGS[name], "intermediate_size": 256}
    ref = random_model(0, random_norms=True, **{k: v for k, v in cfg.items() if k not in TINY_ARGS or TINY_ARGS[k] != v})
    gg = load_gguf_model(tmp_path / "m.gguf")
    assert gg.spec.layer_windows == ref.spec.layer_windows and gg.spec.head_dim == ref.spec.head_dim
    tokens = np.random.default_rng(1).integers(0, 256, 40).tolist()
    assert _logits(gg.model, tokens, gg.spec).tobytes() == _logits(ref.model, tokens, ref.spec).tobytes()


@pytest.fixture(scope="module")
def quantized_gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gg") / "gemma.gguf"
    write_family_gguf("gemma3_text", path, _types(1))
    # The kernels this run already built and bound (a fresh cache dir would rebuild both, ~2 min CPU, and
    # load a second copy of the extension: not what a server does; fresh builds are test_quant_kernel's).
    served = load_served_model(str(path), "q4_1", default_cache_dir())
    e = assert_full_tile(Engine(served.loaded, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield served, e, path
    e.close()


def test_a_gguf_is_served_from_its_blocks_bitwise_its_fp32_dequantization(quantized_gemma, tmp_path):
    """--weights q4_1 (the default) serves the file's blocks of every type; --weights fp32 gguf-py's dequantization."""
    from inference_engine.model.gguf_blocks import has_blocks

    served, engine, path = quantized_gemma
    assert served.weights == "q4_1" and served.note == "" and has_blocks(served.loaded.model)
    fp32 = load_served_model(str(path), "fp32", tmp_path)
    assert fp32.weights == "fp32" and not has_blocks(fp32.loaded.model)
    e = Engine(fp32.loaded, exact=True, max_tile=16, plain_block=64, max_rollback=8)
    try:
        tokens = np.random.default_rng(2).integers(0, 256, 50).tolist()
        assert feed(e, tokens, [50], 2, 12).state_digest() == feed(engine, tokens, [50], 2, 12).state_digest()
    finally:
        e.close()


@pytest.mark.parametrize("plan", ["Nx1", "4 uneven", "random0"])
def test_chunking_invariance_on_a_quantized_gguf(quantized_gemma, plan):
    _, engine, _ = quantized_gemma
    tokens = np.random.default_rng(2).integers(0, 256, 50).tolist()
    ref = feed(engine, tokens, [50], 2, 12)
    v = feed(engine, tokens, chunkings(50)[plan], 2, 12)
    assert v.state_digest() == ref.state_digest()


def test_an_unserved_type_or_architecture_is_named(tmp_path):
    import gguf

    write_family_gguf("llama", tmp_path / "q2.gguf", {"model.layers.1.mlp.down_proj.weight": "Q4_K"})
    data = bytearray((tmp_path / "q2.gguf").read_bytes())
    name = b"blk.1.ffn_down.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # n_dims, two dims, then the type id
    data[at : at + 4] = int(gguf.GGMLQuantizationType.Q2_K).to_bytes(4, "little")
    (tmp_path / "q2.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tensor blk.1.ffn_down.weight has ggml type Q2_K, which is not served"):
        load_gguf_model(tmp_path / "q2.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'phi3' is not supported; supported: gemma3, llama"):
        load_gguf_model(tmp_path / "phi.gguf")


async def test_model_info_reports_family_formats_and_attention_kinds(quantized_gemma):
    from inference_engine.v1 import runtime_pb2 as pb
    from tests.conftest import running_server

    _, engine, _ = quantized_gemma
    async with running_server(engine) as (stub, _):
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.family == "gemma3_text"
    assert list(info.weight_formats) == sorted(set(_types(1).values()) | {"F32"})
    assert list(info.layer_attention) == ["sliding:8", "global"]
