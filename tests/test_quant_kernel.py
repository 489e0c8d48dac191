"""The q4_1 kernel through MLX: the extension's primitive, GGUF-block modules, the probe's fp32 check.

Everything here is bitwise: a model served from a GGUF's blocks must compute exactly what the
converter's fp32 folder computes (a tiny GGUF written by tests/tiny_gguf.py stands in for the
packaged one), and the probe must notice a kernel that does not.
"""

import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from inference_engine import blas, quant_kernel
from inference_engine.model.forward import forward
from inference_engine.model.fused_block import fused_linears
from inference_engine.model.gguf_blocks import (
    BLOCK_BYTES,
    Q4_1,
    Q8_0,
    BlockEmbedding,
    BlockLinear,
    dequantize_blocks,
    has_blocks,
    read_gguf_tensors,
)
from inference_engine.model.gguf_convert import convert_gguf
from inference_engine.model.loader import load_block_model, load_model, model_fingerprint
from inference_engine.quant_kernel import load_quant_kernel
from inference_engine.served_model import load_served_model, q4_1_unavailable
from inference_engine.execution.kv_cache import CacheGeometry, SinkWindowKVCache
from inference_engine.execution.tile_probe import fp32_mismatches, probe_tile
from tests.blas_env import linux_openblas
from tests.test_exact_qgemm import random_blocks
from tests.tiny_gguf import KV_HEADS, LAYERS, write_tiny_gguf
from tests.tiny_models import random_model

pytestmark = linux_openblas


@pytest.fixture(scope="module")
def kernel() -> quant_kernel.QuantKernel:
    found = load_quant_kernel()
    assert not isinstance(found, str), found  # built with the system compilers, loaded by path
    return found


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, kernel):
    """(GGUF path, fp32 folder, the fp32 model, the same model served from the GGUF's blocks)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    gguf = write_tiny_gguf(root / "tiny.gguf")
    convert_gguf(gguf, root / "fp32")
    return gguf, root / "fp32", load_model(root / "fp32"), load_block_model(root / "fp32", gguf, kernel.qmatmul)


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0], ids=["Q4_1", "Q8_0"])
def test_qmatmul_is_the_fp32_matmul(kernel, fmt):
    rng = np.random.default_rng(fmt)
    blocks = random_blocks(rng, fmt, 203, 96)  # an odd count: tiles of one column too
    w = mx.array(dequantize_blocks(blocks, fmt))  # (203, 96) fp32, the converter's weights
    q = mx.array(blocks)
    # every few-row tiling (1; 2..4: 4 x 2; 5..8: 8 x 1; 9..12: both), the many-row path, batch dims
    for shape in [*((m, 96) for m in range(1, 17)), (1, 1, 96), (1, 7, 96), (3, 5, 96), (64, 96)]:
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        got = kernel.qmatmul(x, q, fmt)
        assert got.shape == (*shape[:-1], 203) and got.dtype == mx.float32
        assert mx.array_equal(got, kernel.matmul(x, w)).item(), shape  # the fp32 exact product
    xt = mx.array(rng.standard_normal((96, 6)).astype(np.float32)).T  # not row-contiguous: copied first
    x = mx.array(np.ascontiguousarray(xt))  # (MLX's own matmul would hand A^T to OpenBLAS)
    assert mx.array_equal(kernel.qmatmul(xt, q, fmt), kernel.matmul(x, w)).item()
    strided = mx.array(random_blocks(rng, fmt, 406, 96))[::2]  # every other row: strided blocks, packed first
    w2 = mx.array(dequantize_blocks(np.array(strided), fmt))
    assert mx.array_equal(kernel.qmatmul(x, strided, fmt), kernel.matmul(x, w2)).item()
    compiled = mx.compile(lambda x, q: mx.maximum(kernel.qmatmul(x, q, fmt), 0.0))  # inside a compiled graph
    assert mx.array_equal(compiled(x, q), mx.maximum(kernel.matmul(x, w), 0.0)).item()


def test_qmatmul_refuses_bad_arguments(kernel):
    x = mx.zeros((2, 64))
    q = mx.array(random_blocks(np.random.default_rng(0), Q4_1, 4, 64))
    cases = [
        ((x, q, 10), "fmt must be a ggml type id the kernel reads"),  # Q2_K
        ((x.astype(mx.float16), q, Q4_1), "must be float32"),
        ((x[:, :32], q, Q4_1), "x has 32 features but the blocks hold 40 bytes per row"),
        ((x, q.reshape(2, 2, 40), Q4_1), "2-D uint8"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            kernel.qmatmul(*args)


def test_the_kernel_is_loaded_once_per_library(kernel):
    assert load_quant_kernel() is kernel
    assert os.path.isfile(kernel.extension) and "/native/exact_quant-" in kernel.extension
    assert "/native/exact_gemm-" in kernel.library


def test_the_kernels_load_whatever_blas_is_preloaded(kernel, monkeypatch):
    """No preload, no launcher, any INFERENCE_ENGINE_KERNEL: the library is dlopen()ed by path."""
    monkeypatch.setenv("INFERENCE_ENGINE_KERNEL", "row_gemv")
    monkeypatch.delenv("INFERENCE_ENGINE_BLAS_REEXEC", raising=False)
    assert load_quant_kernel() is kernel
    assert kernel.version.startswith("exact-gemm kernel 3 (")


def test_why_the_exact_kernels_are_unavailable(monkeypatch):
    monkeypatch.setattr(quant_kernel, "build_kernel", lambda kernel, cache_dir=None: "no C compiler (cc)")
    assert load_quant_kernel() == "the exact-gemm kernel cannot be built: no C compiler (cc)"
    monkeypatch.setattr(sys, "platform", "win32")
    assert "built for Linux and macOS; this is win32" in load_quant_kernel()


def test_whether_the_launcher_needs_its_openblas_reexec(kernel, tmp_path, monkeypatch):
    from inference_engine import __main__ as launcher

    assert quant_kernel.exact_kernels_built() and launcher._exact_kernels_built()  # built: no re-exec
    library = Path(kernel.library)  # this run's exact-gemm library, as if built there (compiling it again: ~90 s CPU)
    (tmp_path / "native").mkdir()
    (tmp_path / "native" / library.name).symlink_to(library)
    assert blas.build_kernel("exact_gemm", tmp_path) == tmp_path / "native" / library.name
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert not quant_kernel.exact_kernels_built(tmp_path)  # the library there, no extension, and no C++ compiler
    monkeypatch.setattr(sys, "platform", "darwin")
    assert launcher._exact_kernels_built()  # nothing to re-exec for off Linux


def test_the_link_flags_of_each_platform():
    assert quant_kernel._platform_flags("darwin") == ["-undefined", "dynamic_lookup"]  # Python's symbols at import
    assert quant_kernel._platform_flags("linux") == []


def test_matmul_is_the_exact_gemm_product(kernel):
    """The fp32 primitive: each row bitwise the row alone, at any row count, strided, batched or compiled."""
    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal((203, 96)).astype(np.float32))
    x = mx.array(rng.standard_normal((130, 96)).astype(np.float32))  # past 64 rows: still the kernel's own
    alone = np.concatenate([np.array(kernel.matmul(x[i : i + 1], w)) for i in range(130)])
    for m in (1, 2, 7, 12, 33, 64, 65, 130):
        assert np.array_equal(np.array(kernel.matmul(x[:m], w)), alone[:m]), m
    assert kernel.matmul(x[None, :5], w).shape == (1, 5, 203)
    assert np.array_equal(np.array(kernel.matmul(x[None, :5], w)[0]), alone[:5])
    xt = mx.array(np.ascontiguousarray(np.array(x[:6]).T)).T  # not row-contiguous: packed first
    assert np.array_equal(np.array(kernel.matmul(xt, w)), alone[:6])
    assert np.array_equal(np.array(kernel.matmul(x[:4], mx.concatenate([w, w])[::2])), np.array(kernel.matmul(
        x[:4], mx.concatenate([w, w])[::2] + 0)))  # strided weights, packed first
    compiled = mx.compile(lambda x, w: mx.maximum(kernel.matmul(x, w), 0.0))
    assert np.array_equal(np.array(compiled(x[:3], w)), np.maximum(alone[:3], 0.0))
    assert np.allclose(alone, np.array(x) @ np.array(w).T, rtol=1e-4, atol=1e-4)  # the product, not another


def test_matmul_refuses_bad_arguments(kernel):
    x, w = mx.zeros((2, 64)), mx.zeros((3, 64))
    for args, message in [((x.astype(mx.float16), w), "must be float32"), ((x, w[None]), "must be float32"),
                          ((x[:, :32], w), "x has 32 features but w has 64 columns")]:
        with pytest.raises(ValueError, match=message):
            kernel.matmul(*args)


def test_mlx_headers_are_the_wheels_not_a_folder_named_mlx_here(tmp_path, monkeypatch):
    (tmp_path / "mlx").mkdir()  # e.g. MLX's own cache folder in the current directory
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m` puts the current folder first
    import mlx

    assert Path(list(mlx.__path__)[0]) == tmp_path / "mlx"  # the namespace package does start there
    assert quant_kernel._toolchain()[1] == Path(mx.__file__).resolve().parent


def test_extension_build_failures_are_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert quant_kernel.extension_path(tmp_path) == "no C++ compiler (/nonexistent/c++; apt-get install g++, or set $CXX)"
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    failed = quant_kernel.extension_path(tmp_path)
    assert failed.startswith("building the extension with /") and "false failed" in failed
    assert not [p for p in (tmp_path / "native").iterdir() if p.suffix != ".partial" or any(p.iterdir())]


def test_gguf_directory_matches_gguf_py(tiny_pair):
    import gguf as gguf_py

    path = tiny_pair[0]
    ours, theirs = read_gguf_tensors(path), gguf_py.GGUFReader(str(path)).tensors
    assert [(t.name, t.kind, t.offset, t.shape) for t in ours] == [
        (t.name, int(t.tensor_type), int(t.data_offset), tuple(int(n) for n in reversed(t.shape))) for t in theirs]
    assert [t.row_bytes * int(np.prod(t.shape[:-1])) for t in ours] == [int(t.n_bytes) for t in theirs]
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_tensors(tiny_pair[1] / "config.json")


def test_tiny_gguf_served_from_blocks_is_the_converted_model(tiny_pair):
    _, _, fp32, blocks = tiny_pair
    inner = blocks.model.model
    assert isinstance(inner.embed_tokens, BlockEmbedding) and inner.embed_tokens.fmt == Q8_0
    assert all(isinstance(m, BlockLinear) and m.fmt == Q4_1 for m in fused_linears(blocks.model))
    assert has_blocks(blocks.model) and not has_blocks(fp32.model)
    assert blocks.spec == fp32.spec and model_fingerprint(blocks.model) == model_fingerprint(fp32.model)
    ids = mx.array([[0, 5, 255, 17]])
    assert mx.array_equal(inner.embed_tokens(ids), fp32.model.model.embed_tokens(ids)).item()

    def logits(model, tokens, sizes):
        cache = [SinkWindowKVCache(CacheGeometry(4, 16, 8, 4), KV_HEADS, 16) for _ in range(LAYERS)]
        out, at = [], 0
        for n in sizes:
            out.append(forward(model.model, tokens[at : at + n], cache))
            at += n
        return mx.concatenate(out), [c.digest() for c in cache]

    tokens = np.random.default_rng(2).integers(0, 256, 40).tolist()
    want, want_digests = logits(fp32, tokens, [40])
    for sizes in ([40], [1] * 40, [3, 8, 1, 20, 8]):  # the ring wraps (sink 4 + window 16)
        got, digests = logits(blocks, tokens, sizes)
        assert mx.array_equal(got, want).item() and digests == want_digests, sizes


def test_probe_checks_every_block_shape_against_fp32(tiny_pair):
    _, _, _, blocks = tiny_pair
    probe = probe_tile(blocks.model, max_candidate=8)
    assert probe.tile == 8 and probe.failures == () and probe.is_fp32_equal
    assert probe.block_shapes == ((64, 32), (64, 64), (64, 128), (64, 256), (128, 64))  # fused 64->128 too


def test_probe_catches_a_kernel_that_is_not_the_fp32_one(tiny_pair, kernel):
    """Negative control: a q4 product reduced in another order than the fp32 kernel's."""
    _, _, _, blocks = tiny_pair

    def split_k(x, q, fmt):  # the same weights, K summed in two halves: other roundings
        half = q.shape[1] // 2
        k = x.shape[-1] // 2
        return kernel.qmatmul(x[..., :k], q[:, :half], fmt) + kernel.qmatmul(x[..., k:], q[:, half:], fmt)

    down = blocks.model.model.layers[0].mlp.down_proj
    good = down.qmatmul
    try:
        down.qmatmul = split_k
        found = fp32_mismatches(blocks.model, rows=8)
    finally:
        down.qmatmul = good
    assert len(found) == 1 and found[0].startswith("128->64 Q4_1: M=8 rows [-1, 0, 1, 2] differ from the fp32 kernel")
    assert fp32_mismatches(blocks.model, rows=8) == () and fp32_mismatches(random_model().model) == ()


def test_block_embedding_rows_in_both_formats(kernel):
    rng = np.random.default_rng(8)
    for fmt in (Q4_1, Q8_0):
        blocks = random_blocks(rng, fmt, 50, 64)
        embed = BlockEmbedding(mx.array(blocks), fmt, 64, kernel.qmatmul)
        ids = mx.array([[3, 0, 49, 3]])
        assert mx.array_equal(embed(ids)[0], mx.array(dequantize_blocks(blocks, fmt))[ids[0]]).item()
        x = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
        assert mx.array_equal(embed.as_linear(x), kernel.matmul(x, embed.dequantized())).item()
    with pytest.raises(ValueError, match="not 64 dims of ggml type 8"):
        BlockEmbedding(mx.array(blocks[:, :40]), Q8_0, 64, kernel.qmatmul)
    with pytest.raises(ValueError, match="not 32 features of ggml type 10"):  # Q2_K: no kernel
        BlockLinear(mx.zeros((4, 18), dtype=mx.uint8), 10, 32, kernel.qmatmul)
    assert BLOCK_BYTES == {Q4_1: 20, Q8_0: 34}


def test_served_model_weights_choices(tiny_pair):
    _, folder, _, _ = tiny_pair
    with pytest.raises(ValueError, match="--weights 'int8' is not one of q4_1, fp32"):
        load_served_model(str(folder), "int8", folder)
    why = q4_1_unavailable(str(folder), folder)
    assert why.startswith("q4_1 serves a GGUF's own blocks (packaged:smollm2-135m's, or a .gguf file's); "
                          f"the folder --model {folder} is served from fp32")
    served = load_served_model(str(folder), "q4_1", folder)  # a folder model: fp32, and why
    assert served.weights == "fp32" and served.note == why and not has_blocks(served.loaded.model)
    assert load_served_model(str(folder), "fp32", folder).note == ""


@pytest.fixture
def served_tiny(tiny_pair, kernel, monkeypatch):
    """build_engine's model loading replaced by the tiny pair: q4_1 from blocks, fp32 from the folder."""
    from inference_engine.server import server
    from inference_engine.served_model import ServedModel

    _, _, fp32, blocks = tiny_pair
    calls = []

    def load(model, weights, cache_dir):
        calls.append(weights)
        return ServedModel(blocks, "q4_1", "") if weights == "q4_1" else ServedModel(fp32, "fp32", "")

    monkeypatch.setattr(server, "load_served_model", load)
    return server, calls, blocks


@pytest.mark.parametrize("exact", [True, False])
def test_build_engine_serves_q4_1_and_shares_the_packaged_draft(served_tiny, caplog, exact):
    from tests.conftest import make_config

    server, calls, blocks = served_tiny
    with caplog.at_level("INFO", logger="inference_engine"):
        engine = server.build_engine(make_config(weights="q4_1", exact=exact, max_tile=4))
    try:
        assert calls == ["q4_1"] and engine.loaded is blocks and server.engine_weights(engine) == "q4_1"
        assert engine.draft is blocks  # the packaged draft: the target's own blocks
        assert "weights: the GGUF's blocks as stored (GGUF Q4_1/Q8_0; --weights q4_1)" in caplog.text
    finally:
        engine.close()


@pytest.mark.parametrize("exact", [True, False])
def test_build_engine_falls_back_to_fp32_when_the_kernel_differs(served_tiny, caplog, kernel, exact):
    from tests.conftest import make_config

    server, calls, blocks = served_tiny
    down = blocks.model.model.layers[0].mlp.down_proj  # the probe checks one linear per shape: this one
    down.qmatmul = lambda x, q, fmt: kernel.qmatmul(x, q, fmt) * 1.0000001  # not the fp32 kernel's bits
    try:
        with caplog.at_level("INFO", logger="inference_engine"):
            engine = server.build_engine(make_config(weights="q4_1", exact=exact, max_tile=4, draft_model=None))
    finally:
        down.qmatmul = kernel.qmatmul
    try:
        assert calls == ["q4_1", "fp32"] and server.engine_weights(engine) == "fp32"
        assert "the GGUF block kernel differs from the fp32 kernel (128->64 Q4_1: M=" in caplog.text
    finally:
        engine.close()


def test_an_incomplete_install_is_named(tmp_path, monkeypatch):
    """A package missing its native sources (the wheel once shipped the .c files alone) says so."""
    (tmp_path / "exact_gemm.c").write_text("")
    monkeypatch.setattr(quant_kernel, "_NATIVE", tmp_path)
    monkeypatch.setattr(blas, "_NATIVE", tmp_path)
    why = quant_kernel.extension_path(tmp_path / "cache")
    assert why == (f"exact_quant.cpp, exact_attention.cpp, exact_layer.cpp, exact_matmul.cpp missing from {tmp_path} "
                   "(an incomplete install: reinstall inference_engine)")
    assert blas.build_kernel("row_gemv", tmp_path / "cache") == (
        f"its source {tmp_path / 'row_gemv.c'} is missing from the installed package (reinstall inference_engine)")
    assert blas.build_kernel("openblas", tmp_path / "cache") is None
