"""The exact-gemm kernel's quantized entry: bitwise its own fp32 product of the converter's weights.

`exact_qgemm` reads GGUF Q4_1/Q8_0 blocks; the reference is the same library's cblas_sgemm on
the weights gguf-py dequantizes (what model/gguf_convert.py serves), both called through a
ctypes-loaded copy. Equal rows for every block size and offset make the quantized product
row-invariant too (the fp32 one is, test_exact_gemm.py).
"""

import ctypes

import numpy as np
import pytest

from inference_engine.blas import kernel_library
from inference_engine.model.gguf_blocks import BLOCK_BYTES, Q4_1, Q8_0, dequantize_blocks
from tests.concurrent_calls import differing_calls
from tests.blas_env import linux_openblas
from tests.test_exact_gemm import HEAD, SMOLLM2_SHAPES, Gemm

pytestmark = linux_openblas


class QGemm:
    """exact_qgemm of a loaded library on numpy arrays."""

    def __init__(self, path: str):
        self.fn = ctypes.CDLL(path).exact_qgemm
        p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        self.fn.argtypes = [i, i, i, i, p, n, p, n, p, n]
        self.fn.restype = i

    def status(self, fmt, x, blocks, c=None, k=None, ldq=None):
        m, n = x.shape[0], blocks.shape[0]
        c = np.full((m, n), np.nan, np.float32) if c is None else c
        k = x.shape[1] if k is None else k
        return self.fn(fmt, m, n, k, x.ctypes.data, x.strides[0] // 4, blocks.ctypes.data,
                       blocks.strides[0] if ldq is None else ldq, c.ctypes.data, c.strides[0] // 4), c

    def __call__(self, fmt, x, blocks):
        status, c = self.status(fmt, x, blocks)
        assert status == 0
        return c


@pytest.fixture(scope="module")
def lib() -> str:
    path = kernel_library("exact_gemm")
    assert path is not None, "the exact-gemm kernel did not build"
    return path


@pytest.fixture(scope="module")
def qgemm(lib) -> QGemm:
    return QGemm(lib)


@pytest.fixture(scope="module")
def gemm(lib) -> Gemm:
    return Gemm(lib)


def random_blocks(rng, fmt, n, k, scale=0.05):
    """n rows of k/32 random blocks with plausible fp16 scales (negative m and d too)."""
    blocks = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[fmt]), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 32)) * scale).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    if fmt == Q4_1:
        m = (rng.standard_normal((n, k // 32)) * scale * 8).astype(np.float16)
        blocks[..., 2:4] = m.view(np.uint8).reshape(n, k // 32, 2)
    return blocks.reshape(n, -1)


def mismatches(qgemm, gemm, fmt, x, blocks, sizes):
    """[(offset, M)] whose quantized rows differ from the fp32 kernel's on the dequantized weights."""
    w = dequantize_blocks(blocks, fmt)
    bad = []
    for offset in (0, 1):
        for m in sizes:
            a = np.ascontiguousarray(x[offset : offset + m])
            if qgemm(fmt, a, blocks).tobytes() != gemm(a, w).tobytes():
                bad.append((offset, m))
    return bad


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0], ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("k,n", SMOLLM2_SHAPES)
def test_smollm2_shapes_every_block_size_equals_fp32(qgemm, gemm, fmt, k, n):
    rng = np.random.default_rng(k + n + fmt)
    x = rng.standard_normal((65, k), dtype=np.float32)
    assert mismatches(qgemm, gemm, fmt, x, random_blocks(rng, fmt, n, k), range(1, 65)) == []


def test_lm_head_shape_equals_fp32(qgemm, gemm):
    """576 -> 49152 in Q8_0 (the tied embedding) at the block sizes where tiles change."""
    k, n = HEAD
    rng = np.random.default_rng(1)
    x = rng.standard_normal((65, k), dtype=np.float32)
    assert mismatches(qgemm, gemm, Q8_0, x, random_blocks(rng, Q8_0, n, k), [1, 2, 3, 4, 5, 8, 9, 64]) == []


@pytest.mark.parametrize("k,n", [(32, 1), (32, 3), (64, 5), (96, 7), (160, 50), (32, 200)])
@pytest.mark.parametrize("fmt", [Q4_1, Q8_0], ids=["Q4_1", "Q8_0"])
def test_odd_shapes_and_tails(qgemm, gemm, fmt, k, n):
    """Column counts off the 4-column (one row) and 3-column (more rows) tiles, one-block rows."""
    rng = np.random.default_rng(k * n)
    x = rng.standard_normal((9, k), dtype=np.float32)
    assert mismatches(qgemm, gemm, fmt, x, random_blocks(rng, fmt, n, k), range(1, 9)) == []


def test_every_weight_is_the_converters(qgemm):
    """Identity rows read the weights back: fp16 specials (subnormal, signed zero, large) decode exactly."""
    halves = np.array([0x0001, 0x03FF, 0x0400, 0x8000, 0x0000, 0x7BFF, 0xFBFF, 0x3C00, 0x8001, 0x2E66], np.uint16)
    rng = np.random.default_rng(3)
    for fmt in (Q4_1, Q8_0):
        blocks = random_blocks(rng, fmt, len(halves) ** 2 if fmt == Q4_1 else len(halves), 32)
        scales = blocks.reshape(len(blocks), -1)
        if fmt == Q4_1:
            pairs = np.stack(np.meshgrid(halves, halves), -1).reshape(-1, 2)  # every (d, m)
            scales[:, 0:4] = pairs.view(np.uint8).reshape(-1, 4)
        else:
            scales[:, 0:2] = halves.view(np.uint8).reshape(-1, 2)
        eye = np.eye(32, dtype=np.float32)
        got = qgemm(fmt, eye, blocks).T  # (rows, 32): row n's weights
        want = dequantize_blocks(blocks, fmt)
        assert np.isfinite(want).all() and np.array_equal(got, want)


def test_refusals_and_empty_calls(qgemm):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 64), dtype=np.float32)
    blocks = random_blocks(rng, Q4_1, 5, 64)
    assert qgemm.status(10, x, blocks)[0] == -1  # Q2_K: no kernel reads it
    assert qgemm.status(Q4_1, x, blocks, k=48)[0] == -1  # K not a multiple of 32
    assert qgemm.status(Q4_1, x, blocks, ldq=39)[0] == -1  # rows shorter than their blocks
    status, c = qgemm.status(Q4_1, x[:, :0], blocks[:, :0], k=0, ldq=0)
    assert status == 0 and np.all(c == 0)  # K = 0: an empty sum
    assert qgemm.status(Q4_1, x[:0], blocks, c=np.empty((1, 5), np.float32)[:0])[0] == 0  # M = 0: nothing to do


def test_concurrent_callers_get_the_same_bits(qgemm):
    """MLX's stream thread and others may call at once: one holds the pool, the rest compute inline."""
    rng = np.random.default_rng(6)
    blocks = random_blocks(rng, Q4_1, 3072, 576)
    xs = [rng.standard_normal((m, 576), dtype=np.float32) for m in (1, 4, 7, 16)]
    assert differing_calls(lambda x: qgemm(Q4_1, x, blocks), xs) == []


@pytest.mark.parametrize("env", ["EXACT_GEMM_NO_AVX512", "EXACT_GEMM_PORTABLE"])
def test_every_instruction_set_gives_the_same_bits(lib, qgemm, gemm, env, tmp_path):
    """A process held off AVX-512 (AVX2 + FMA tiles; AVX-512 runs q4 calls and fp32 calls of more than 32 rows) or off
    every vector extension (portable C, libm's fmaf lane by
    lane: a CPU without AVX2/FMA) computes the very bits this one does, quantized and fp32, both layouts. Where the
    CPU lacks the extension, both runs take the same path."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng(7)
    cases = [(fmt, rng.standard_normal((m, k), dtype=np.float32), random_blocks(rng, fmt, n, k))
             for fmt, k, n in ((Q4_1, 576, 1539), (Q4_1, 1536, 577), (Q8_0, 576, 1027))  # odd n: a 1..3-column tail
             for m in (1, 3, 8, 12, 13, 23, 64)]
    cases += [(trans, rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
              for trans, k, shape in (("nt", 576, (963, 576)), ("nt", 67, (37, 67)), ("nn", 67, (67, 61)))  # nn: w @ v
              for m in (1, 5, 13, 64)]
    for i, (fmt, x, w) in enumerate(cases):
        np.save(tmp_path / f"x{i}.npy", x)
        np.save(tmp_path / f"b{i}.npy", w)
    script = (
        "import sys, numpy as np; sys.path.insert(0, '.'); from tests.test_exact_qgemm import QGemm\n"
        "from tests.test_exact_gemm import Gemm\n"
        f"q, g = QGemm({lib!r}), Gemm({lib!r})\n"
        f"for i, fmt in enumerate({[fmt for fmt, _, _ in cases]!r}):\n"
        f"    x, w = np.load('{tmp_path}/x%d.npy' % i), np.load('{tmp_path}/b%d.npy' % i)\n"
        f"    c = g(x, w, trans_b=fmt == 'nt') if isinstance(fmt, str) else q(fmt, x, w)\n"
        f"    np.save('{tmp_path}/c%d.npy' % i, c)\n"
    )
    subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **{env: "1"}), check=True, cwd=os.getcwd())
    for i, (fmt, x, w) in enumerate(cases):
        here = gemm(x, w, trans_b=fmt == "nt") if isinstance(fmt, str) else qgemm(fmt, x, w)
        assert np.array_equal(here.view(np.uint32), np.load(tmp_path / f"c{i}.npy").view(np.uint32)), (env, i)
