"""The cblas_sgemm interposers: chosen and built by the launcher; row-gemv row-invariant and sound.

The exact-gemm kernel's own checks are in test_exact_gemm.py.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from inference_engine.blas import find_openblas, interposer_library, kernel_library, selected_kernel
from tests.blas_env import linux_openblas

pytestmark = linux_openblas

# Runs with LD_PRELOAD=<interposer>:<openblas>; prints what it found as JSON.
PROBE = textwrap.dedent("""
    import json
    import mlx.core as mx
    import numpy as np
    from inference_engine.blas import active_blas

    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 96)).astype(np.float32)
    w = rng.standard_normal((80, 96)).astype(np.float32)  # (out, in) like a Linear weight
    bias = rng.standard_normal(80).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    single = [np.array(mx.array(x[i:i + 1]) @ mx.array(w).T)[0] for i in range(20)]
    out = {"blas": active_blas(), "invariant_rows": [], "close": [], "close_notrans": [], "close_addmm": []}
    for m in range(1, 21):
        block = np.array(mx.array(x[:m]) @ mx.array(w).T)
        out["invariant_rows"].append(all(np.array_equal(block[i], single[i]) for i in range(m)))
        out["close"].append(bool(np.allclose(block, ref[:m], rtol=1e-4, atol=1e-4)))
        notrans = np.array(mx.array(x[:m]) @ mx.array(np.ascontiguousarray(w.T)))  # B stored (in, out)
        out["close_notrans"].append(bool(np.allclose(notrans, ref[:m], rtol=1e-4, atol=1e-4)))
        addmm = np.array(mx.addmm(mx.array(bias), mx.array(x[:m]), mx.array(w).T))  # beta = 1: C starts as the bias
        out["close_addmm"].append(bool(np.allclose(addmm, ref[:m] + bias, rtol=1e-4, atol=1e-4)))
    print(json.dumps(out))
""")


def test_built_once_into_the_cache(tmp_path):
    lib = kernel_library("row_gemv", tmp_path)
    assert lib is not None and os.path.isfile(lib) and "/native/row_gemv-" in lib
    stamp = os.stat(lib).st_mtime_ns
    assert kernel_library("row_gemv", tmp_path) == lib and os.stat(lib).st_mtime_ns == stamp  # reused, not rebuilt
    assert "/native/exact_gemm-" in kernel_library("exact_gemm")  # the default kernel (test_exact_gemm.py)


def test_selected_kernel(monkeypatch):
    monkeypatch.delenv("INFERENCE_ENGINE_KERNEL", raising=False)
    monkeypatch.delenv("INFERENCE_ENGINE_NO_ROW_GEMV", raising=False)
    assert selected_kernel() == "exact_gemm"
    monkeypatch.setenv("INFERENCE_ENGINE_KERNEL", "row_gemv")
    assert selected_kernel() == "row_gemv"
    monkeypatch.setenv("INFERENCE_ENGINE_NO_ROW_GEMV", "1")  # the older switch: OpenBLAS alone
    assert selected_kernel() == "openblas" and interposer_library() is None
    monkeypatch.delenv("INFERENCE_ENGINE_NO_ROW_GEMV")
    monkeypatch.setenv("INFERENCE_ENGINE_KERNEL", "fast")
    with pytest.raises(ValueError, match="INFERENCE_ENGINE_KERNEL='fast' is not a kernel; choose one of exact_gemm"):
        selected_kernel()


def test_without_a_compiler_it_is_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert kernel_library("row_gemv", tmp_path) is None
    assert "no C compiler" in capsys.readouterr().err
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    assert kernel_library("exact_gemm", tmp_path) is None
    assert "failed" in capsys.readouterr().err and not list((tmp_path / "native").glob("*"))


def test_small_blocks_are_row_invariant_and_correct(tmp_path):
    lib = kernel_library("row_gemv", tmp_path)
    env = dict(os.environ, LD_PRELOAD=f"{lib}:{find_openblas()}")
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["blas"].endswith("+ row-gemv interposer")
    assert out["invariant_rows"][:16] == [True] * 16  # every block of <= 16 rows: a row's bits never depend on it
    assert all(out["close"]) and all(out["close_notrans"]) and all(out["close_addmm"])  # including > 16 (real sgemm)
