"""The cblas_sgemm interposers: chosen and built by the launcher; row-gemv row-invariant and sound.

The exact-gemm kernel's own checks are in test_exact_gemm.py.
"""

import os

import pytest

from inference_engine.blas import find_openblas, interposer_library, kernel_library, selected_kernel
from tests.blas_env import linux_openblas
from tests.mlx_matmul_probe import probe

pytestmark = linux_openblas



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
    out = probe(f"{kernel_library('row_gemv', tmp_path)}:{find_openblas()}", rows=20, outs=80)
    assert out["blas"].endswith("+ row-gemv interposer")
    assert out["invariant_rows"][:16] == [True] * 16  # every block of <= 16 rows: a row's bits never depend on it
    assert all(out["close"]) and all(out["close_notrans"]) and all(out["close_addmm"])  # including > 16 (real sgemm)
