"""The test run's own guards: on Linux it refuses to start without the native kernels, and a probe
that shrank the tile fails the fixture that built the engine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference_engine.runtime.engine import Engine
from tests import kernel_guard

ROOT = Path(__file__).resolve().parent.parent


def test_this_run_computes_with_the_native_kernels_on_linux():
    path, problem = kernel_guard.bind_test_kernels()
    assert problem == ""
    if sys.platform.startswith("linux"):
        assert path.startswith("native kernels") and kernel_guard.is_kernel_bound()


def _pytest_env(**extra: str) -> dict[str, str]:
    """This environment without LD_PRELOAD (and coverage's child hooks), plus `extra`."""
    drop = ("LD_PRELOAD", "COV_CORE_SOURCE", "COV_CORE_CONFIG", "COV_CORE_DATAFILE")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux run's requirement")
def test_a_run_without_ld_preload_binds_the_native_kernels():
    """pytest started without scripts/run_tests.sh (no LD_PRELOAD): the exact kernels bind all the same."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only",
                          "tests/test_kernel_guard.py"], cwd=ROOT, env=_pytest_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "inference_engine arithmetic: native kernels (attention and whole block" in out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux run's requirement")
def test_a_run_whose_kernel_cannot_build_stops_with_the_reason(tmp_path):
    """No C compiler and nothing built in the cache: a usage error naming the cause, not the MLX-ops path."""
    env = _pytest_env(INFERENCE_ENGINE_CACHE=str(tmp_path), CC="no-such-cc", CXX="no-such-c++")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                          "tests/test_kernel_guard.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "the native kernels did not bind (no C++ compiler (no-such-c++;" in out.stderr
    assert kernel_guard.RUN_TESTS in out.stderr


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_a_kernel_that_does_not_bind_fails_on_linux_only(monkeypatch, platform):
    monkeypatch.setattr(kernel_guard, "enable_native_kernels", lambda: "no C++ compiler (c++)")
    path, problem = kernel_guard.bind_test_kernels(platform)
    assert path == ("MLX ops" if platform == "linux" else "MLX ops (no C++ compiler (c++))")
    assert ("no C++ compiler (c++)" in problem and "MLX-ops path" in problem) == (platform == "linux")


def test_attention_without_the_whole_block_kernel_fails_on_linux(monkeypatch):
    monkeypatch.setattr(kernel_guard, "load_quant_kernel", lambda: "the exact-gemm kernel cannot be built: ...")
    path, problem = kernel_guard.bind_test_kernels("linux")
    assert path == "native attention, MLX-ops blocks" and "the exact-gemm kernel cannot be built" in problem


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
