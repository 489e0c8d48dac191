"""The exact-gemm kernel: every row's bits independent of its block, and numerically sound.

The kernel is called directly through a ctypes-loaded copy (all its cases have <= 64 rows,
so nothing is forwarded); one subprocess runs MLX with it preloaded in front of OpenBLAS,
as the launcher does, for the forwarded cases and what MLX actually passes.
"""

import ctypes
import os

import numpy as np
import pytest

from inference_engine.blas import find_openblas, kernel_library
from tests.concurrent_calls import differing_calls
from tests.blas_env import linux_openblas
from tests.mlx_matmul_probe import probe

pytestmark = linux_openblas

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
SMOLLM2_SHAPES = [(576, 192), (576, 576), (576, 960), (576, 1536), (576, 3072), (1536, 576)]  # (K, N)
HEAD = (576, 49152)
ODD_SHAPES = [(1, 5), (3, 7), (7, 9), (8, 8), (9, 17), (13, 23), (31, 50), (33, 49), (100, 25), (577, 61)]


class Gemm:
    """cblas_sgemm of a loaded library on numpy arrays (row-major, A not transposed)."""

    def __init__(self, path: str):
        self.fn = ctypes.CDLL(path).cblas_sgemm
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self.fn.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
        self.fn.restype = None

    def __call__(self, a, b, trans_b=True, alpha=1.0, beta=0.0, c=None, n_cols=None):
        """C = alpha * a @ op(b) + beta * C; `c` may be a wider view (ldc > n); b is (N, K) if trans_b."""
        m, k = a.shape
        n = n_cols or (b.shape[0] if trans_b else b.shape[1])
        if c is None:
            c = np.full((m, n), np.nan, np.float32)  # beta == 0 must never read it
        for x in (a, b, c):
            assert x.dtype == np.float32 and x.strides[1] == 4
        self.fn(ROW_MAJOR, NO_TRANS, TRANS if trans_b else NO_TRANS, m, n, k, alpha, a.ctypes.data,
                a.strides[0] // 4, b.ctypes.data, b.strides[0] // 4, beta, c.ctypes.data, c.strides[0] // 4)
        return c


@pytest.fixture(scope="module")
def gemm() -> Gemm:
    lib = kernel_library("exact_gemm")
    assert lib is not None, "the exact-gemm kernel did not build"
    return Gemm(lib)


def variant_blocks(gemm, x, w, sizes, trans_b=True, which=None):
    """[(offset, M, rows)] whose rows differ from the same rows computed one at a time.

    With `which`, row i of the blocks is x[which[i]] (so only len(x) single rows are computed).
    """
    singles = np.concatenate([gemm(x[i : i + 1], w, trans_b) for i in range(len(x))])
    if which is not None:
        x, singles = x[which], singles[which]
    bad = []
    for offset in (0, 1):
        for m in sizes:
            block = gemm(x[offset : offset + m], w, trans_b)
            rows = [i for i in range(m) if block[i].tobytes() != singles[offset + i].tobytes()]
            if rows:
                bad.append((offset, m, rows[:4]))
    return bad


def assert_close(c, a, b_nk, alpha=1.0, beta=0.0, c0=None):
    """Within fp32 rounding of the float64 product (scaled by the magnitudes summed)."""
    a64, b64 = a.astype(np.float64), b_nk.astype(np.float64)
    ref = alpha * (a64 @ b64.T) + (beta * c0.astype(np.float64) if beta else 0.0)
    scale = abs(alpha) * (np.abs(a64) @ np.abs(b64).T) + (abs(beta) * np.abs(c0) if beta else 0.0)
    assert np.all(np.abs(c - ref) <= 2e-6 * scale + 1e-30), float(np.max(np.abs(c - ref) / (scale + 1e-30)))


@pytest.mark.parametrize("k,n", SMOLLM2_SHAPES)
def test_smollm2_shapes_every_block_size_is_row_invariant(gemm, k, n):
    rng = np.random.default_rng(k + n)
    x = rng.standard_normal((65, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)  # (out, in): MLX's x @ W.T
    assert variant_blocks(gemm, x, w, range(1, 65)) == []
    assert_close(gemm(x[:64], w), x[:64], w)


def test_lm_head_shape_is_row_invariant(gemm):
    """576 -> 49152 at the block sizes where tiles change (all 64 would take seconds), 6 distinct rows."""
    k, n = HEAD
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    which = rng.integers(0, 6, 65)
    assert variant_blocks(gemm, x, w, [1, 2, 3, 5, 8, 9, 64], which=which) == []
    assert_close(gemm(x, w), x, w)


@pytest.mark.parametrize("k,n", ODD_SHAPES)
@pytest.mark.parametrize("trans_b", [True, False], ids=["B(N,K)", "B(K,N)"])
def test_odd_shapes_both_layouts(gemm, k, n, trans_b):
    rng = np.random.default_rng(k * n)
    x = rng.standard_normal((65, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    b = w if trans_b else np.ascontiguousarray(w.T)
    assert variant_blocks(gemm, x, b, range(1, 65), trans_b) == []
    assert_close(gemm(x[:64], b, trans_b), x[:64], w)


@pytest.mark.parametrize("trans_b", [True, False], ids=["B(N,K)", "B(K,N)"])
def test_alpha_beta_and_leading_dimensions(gemm, trans_b):
    """alpha != 1, beta != 0, lda > k, ldb > k (or n), ldc > n: same bits in any block, and correct."""
    k, n, pad = 100, 70, 3
    rng = np.random.default_rng(5)
    a_wide = rng.standard_normal((65, k + pad), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    b = w if trans_b else w.T
    b_wide = np.zeros((b.shape[0], b.shape[1] + pad), np.float32)  # ldb = k + pad or n + pad
    b_wide[:, : b.shape[1]] = b
    c0 = rng.standard_normal((65, n + pad), dtype=np.float32)
    a = a_wide[:, :k]  # lda = k + pad

    def run(lo, hi):
        c = c0[lo:hi].copy()
        gemm(a[lo:hi], b_wide, trans_b, alpha=1.5, beta=0.25, c=c, n_cols=n)  # ldc = n + pad
        assert np.array_equal(c[:, n:], c0[lo:hi, n:])  # columns past n untouched
        return c[:, :n]

    singles = np.concatenate([run(i, i + 1) for i in range(65)])
    for offset in (0, 1):
        for m in range(1, 65):
            assert run(offset, offset + m).tobytes() == singles[offset : offset + m].tobytes(), (offset, m)
    assert_close(run(0, 64), a[:64], w, alpha=1.5, beta=0.25, c0=c0[:64, :n])


def test_beta_zero_never_reads_c_and_k_zero(gemm):
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((3, 40), dtype=np.float32), rng.standard_normal((50, 40), dtype=np.float32)
    assert not np.isnan(gemm(x, w)).any()  # C starts as NaN
    c = np.full((3, 50), 2.0, np.float32)
    gemm(x[:, :0], w[:, :0], alpha=1.0, beta=0.5, c=c)  # K = 0: C = beta * C
    assert np.all(c == 1.0)


@pytest.mark.parametrize("m", [1, 2, 5, 13])
def test_each_step_is_one_fused_multiply_add(gemm, m):
    """Lane 0 of column 0 holds -(1 + 2^-11) after k = 0 and meets (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 at k = 8:
    one rounding (fused) leaves 2^-24; a rounded product (1 + 2^-11, the tie to even) then an add leaves 0. Every
    tile shape (m rows) and both layouts must fuse, and nothing else may be fused or reordered."""
    e = np.float32(1 + 2.0**-12)
    x = np.zeros((m, 9), np.float32)
    x[:, 0], x[:, 8] = -(1 + 2.0**-11), e
    w_nk = np.zeros((3, 9), np.float32)
    w_nk[:, 0], w_nk[:, 8] = 1.0, e
    for c in (gemm(x, w_nk), gemm(x, np.ascontiguousarray(w_nk.T), trans_b=False)):
        assert np.all(c == np.float32(2.0**-24)), c
    # a third product in lane 1 keeps the lanes apart (hsum8 adds it last): 2^-24 + 3 rounds to 3
    x[:, 1], w_nk[:, 1] = 1.0, 3.0
    assert np.all(gemm(x, w_nk) == 3.0)


def test_concurrent_callers_get_the_same_bits(gemm):
    """MLX may call from several threads: one holds the pool, the others compute inline."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3072, 576), dtype=np.float32)
    xs = [rng.standard_normal((m, 576), dtype=np.float32) for m in (1, 4, 7, 16)]
    assert differing_calls(lambda x: gemm(x, w), xs) == []


def test_a_forked_child_computes(gemm):
    """The workers do not survive fork(); the child's pool starts afresh instead of hanging."""
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((8, 576), dtype=np.float32), rng.standard_normal((960, 576), dtype=np.float32)
    expected = gemm(x, w)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's result is its exit status
        os._exit(0 if gemm(x, w).tobytes() == expected.tobytes() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_check_detects_a_batch_variant_blas():
    """Negative control: OpenBLAS's own sgemm gives rows that depend on the block size."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((65, 576), dtype=np.float32)
    w = rng.standard_normal((192, 576), dtype=np.float32)
    assert variant_blocks(Gemm(find_openblas()), x, w, range(1, 65)) != []


def test_preloaded_in_front_of_openblas_under_mlx():
    out = probe(f"{kernel_library('exact_gemm')}:{find_openblas()}", rows=80, outs=72)
    assert out["blas"].startswith("openblas: ") and out["blas"].endswith("+ exact-gemm kernel 3 (max rows 64, 8-lane fused multiply-add; "
                                                                     "F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights)")
    assert out["invariant_rows"][:64] == [True] * 64  # every block of <= 64 rows: a row's bits never depend on it
    assert all(out["close"]) and all(out["close_notrans"]) and all(out["close_addmm"])  # including > 64 (OpenBLAS)
    assert out["close_attention"] and out["close_trans_a"]
