"""exact_qgemm on every other GGUF type it reads as stored: bitwise the fp32 product of gguf-py's dequantization.

F16, BF16, Q4_0, Q5_0 and Q5_1 blocks are written by gguf-py's own quantizers
(`gguf.quants.quantize`) from small random matrices; gguf-py has no quantizer for Q4_K, Q5_K
and Q6_K, so their blocks are random bytes (every bit pattern is a valid block) with plausible
fp16 scales. The reference is the same library's cblas_sgemm on `gguf.quants.dequantize` of
those blocks; every block size 1..64 at two offsets equals it (so the product is row-invariant,
the fp32 one being so: test_exact_gemm.py), and so does the portable C path (EXACT_GEMM_PORTABLE=1).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from inference_engine.model.gguf_blocks import dequantize_blocks
from tests.blas_env import linux_openblas
from tests.test_exact_qgemm import QGemm, gemm, lib, qgemm  # noqa: F401 (fixtures)

pytestmark = linux_openblas

F16, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, BF16 = 1, 2, 6, 7, 12, 13, 14, 30
NAMES = {F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q5_0: "Q5_0", Q5_1: "Q5_1", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
SUPER = {Q4_K: (144, ((0, 2), (2, 4))), Q5_K: (176, ((0, 2), (2, 4))), Q6_K: (210, ((208, 210),))}  # bytes, fp16 fields


def make_blocks(rng: np.random.Generator, fmt: int, n: int, k: int) -> np.ndarray:
    """(n, row bytes) uint8: gguf-py's quantization of a random (n, k) matrix, or random K-quant super-blocks."""
    import gguf

    if fmt in SUPER:
        size, halves = SUPER[fmt]
        blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
        for lo, hi in halves:  # d (and dmin): small fp16 of either sign
            blocks[..., lo:hi] = (rng.standard_normal((n, k // 256, 1)) * 0.01).astype(np.float16).view(np.uint8)
        return blocks.reshape(n, -1)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType(fmt))
    return np.ascontiguousarray(q.view(np.uint8).reshape(n, -1))


@pytest.mark.parametrize("fmt", list(NAMES), ids=list(NAMES.values()))
def test_every_block_size_equals_the_fp32_product(qgemm, gemm, fmt):
    """M = 1..64 rows at offsets 0 and 1, 37 columns (off every tile's width), two K-quant super-blocks."""
    rng = np.random.default_rng(fmt)
    k, n = 512, 37
    blocks = make_blocks(rng, fmt, n, k)
    w = dequantize_blocks(blocks, fmt)
    assert np.isfinite(w).all()
    x = rng.standard_normal((65, k), dtype=np.float32)
    bad = [(offset, m) for offset in (0, 1) for m in range(1, 65)
           if qgemm(fmt, np.ascontiguousarray(x[offset : offset + m]), blocks).tobytes()
           != gemm(np.ascontiguousarray(x[offset : offset + m]), w).tobytes()]
    assert bad == []


@pytest.mark.parametrize("fmt", list(NAMES), ids=list(NAMES.values()))
def test_every_weight_is_gguf_pys(qgemm, fmt):
    """Identity rows read the dequantized weights back: each one is gguf-py's, bit for bit."""
    rng = np.random.default_rng(100 + fmt)
    blocks = make_blocks(rng, fmt, 9, 256)
    got = qgemm(fmt, np.eye(256, dtype=np.float32), blocks).T  # (rows, 256)
    assert np.array_equal(got, dequantize_blocks(blocks, fmt))


def test_fp16_specials_decode_exactly(qgemm):
    """F16 weights that are subnormal, signed zero, the largest finite or plain: numpy's astype(float32)."""
    halves = np.array([0x0001, 0x03FF, 0x0400, 0x8000, 0x0000, 0x7BFF, 0xFBFF, 0x3C00, 0x8001, 0x2E66] * 4, np.uint16)
    blocks = halves[None, :32].view(np.uint8).copy()
    got = qgemm(F16, np.eye(32, dtype=np.float32), blocks).T
    assert np.array_equal(got.view(np.uint32) & 0x7FFFFFFF, dequantize_blocks(blocks, F16).view(np.uint32) & 0x7FFFFFFF)


def test_k_quants_refuse_partial_super_blocks(qgemm):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 288), dtype=np.float32)
    blocks = rng.integers(0, 256, (3, 288 // 32 * 18), dtype=np.uint8)
    assert qgemm.status(Q4_0, x, blocks)[0] == 0  # 9 blocks of 32
    for fmt in (Q4_K, Q5_K, Q6_K):
        assert qgemm.status(fmt, x, np.zeros((3, 210 * 2), np.uint8))[0] == -1  # 288 is not whole super-blocks
    assert qgemm.status(10, x[:, :256], np.zeros((3, 84), np.uint8))[0] == -1  # Q2_K: no kernel


def test_portable_path_gives_the_same_bits(lib, qgemm, tmp_path):
    """EXACT_GEMM_PORTABLE=1 (plain C, libm's fmaf: a CPU without AVX2, the reference of other ports)."""
    rng = np.random.default_rng(8)
    cases = [(fmt, rng.standard_normal((m, 512), dtype=np.float32), make_blocks(rng, fmt, 13, 512))
             for fmt in NAMES for m in (1, 5, 13)]
    for i, (fmt, x, b) in enumerate(cases):
        np.save(tmp_path / f"x{i}.npy", x)
        np.save(tmp_path / f"b{i}.npy", b)
    script = (
        "import sys, numpy as np; sys.path.insert(0, '.'); from tests.test_exact_qgemm import QGemm\n"
        f"q = QGemm({lib!r})\n"
        f"for i, fmt in enumerate({[fmt for fmt, _, _ in cases]!r}):\n"
        f"    np.save('{tmp_path}/c%d.npy' % i, q(fmt, np.load('{tmp_path}/x%d.npy' % i), np.load('{tmp_path}/b%d.npy' % i)))\n"
    )
    subprocess.run([sys.executable, "-c", script], env=dict(os.environ, EXACT_GEMM_PORTABLE="1"), check=True,
                   cwd=os.getcwd())
    for i, (fmt, x, b) in enumerate(cases):
        here = qgemm(fmt, x, b)
        assert np.array_equal(here.view(np.uint32), np.load(tmp_path / f"c{i}.npy").view(np.uint32)), NAMES[fmt]
