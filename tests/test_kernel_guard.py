"""The test run's own guards: on Linux it refuses to start without the native kernels, and a probe
that shrank the tile fails the fixture that built the engine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference_engine.runtime.engine import Engine
from tests import kernel_guard
from tests.blas_env import linux_openblas

ROOT = Path(__file__).resolve().parent.parent


def test_this_run_computes_with_the_native_kernels_on_linux():
    path, problem = kernel_guard.bind_test_kernels()
    assert problem == ""
    if sys.platform.startswith("linux"):
        assert path.startswith("native kernels") and kernel_guard.is_kernel_bound()


@linux_openblas
def test_a_run_without_the_preloaded_kernel_stops_with_the_reason():
    """pytest started without scripts/run_tests.sh (no LD_PRELOAD): a usage error, not the MLX-ops path."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "COV_CORE_SOURCE", "COV_CORE_CONFIG",
                                                             "COV_CORE_DATAFILE")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                          "tests/test_kernel_guard.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "the native kernels did not bind (the exact-gemm kernel is not preloaded" in out.stderr
    assert kernel_guard.RUN_TESTS in out.stderr


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_a_kernel_that_does_not_bind_fails_on_linux_only(monkeypatch, platform):
    monkeypatch.setattr(kernel_guard, "enable_native_kernels", lambda: "no C++ compiler (c++)")
    path, problem = kernel_guard.bind_test_kernels(platform)
    assert path == ("MLX ops" if platform == "linux" else "MLX ops (no C++ compiler (c++))")
    assert ("no C++ compiler (c++)" in problem and "MLX-ops path" in problem) == (platform == "linux")


def test_attention_without_the_whole_block_kernel_fails_on_linux(monkeypatch):
    monkeypatch.setattr(kernel_guard, "load_quant_kernel", lambda: "INFERENCE_ENGINE_KERNEL=openblas: q4_1 ...")
    path, problem = kernel_guard.bind_test_kernels("linux")
    assert path == "native attention, MLX-ops blocks" and "INFERENCE_ENGINE_KERNEL=openblas" in problem


def test_a_shrunk_tile_fails_the_guard(tiny):
    engine = Engine(tiny, exact=True, max_tile=8, plain_block=64, max_rollback=4)
    assert kernel_guard.assert_full_tile(engine) is engine  # the probe found the whole 8
    engine.close()
    shrunk = Engine(tiny, exact=True, max_tile=8, plain_block=64, max_rollback=4)
    shrunk.block = 1  # what a probe that failed at 2 rows leaves
    expected = "not the configured 8" if kernel_guard.is_kernel_bound() else "chunkings would not differ"
    with pytest.raises(AssertionError, match=expected):
        kernel_guard.assert_full_tile(shrunk)
    plain = Engine(tiny, exact=False, max_tile=8, plain_block=64, max_rollback=4)
    with pytest.raises(AssertionError, match="not on the exact path"):
        kernel_guard.assert_full_tile(plain)
