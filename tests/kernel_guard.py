"""Which arithmetic the test run computes with, and the guards that keep the batteries honest.

On Linux the native kernels must bind (attention, whole block and the fp32 product primitive,
all computed by the exact-gemm library loaded by path: no LD_PRELOAD is needed), or every
exactness battery would test the MLX-ops fallback (and a probe that shrank the tile would make
every chunking run the same computation). Elsewhere blocks may stay MLX ops and the run says so.
"""

from __future__ import annotations

import sys

from inference_engine.model import native_kernels
from inference_engine.quant_kernel import enable_native_kernels, load_quant_kernel
from inference_engine.runtime.engine import Engine

RUN_TESTS = "bash scripts/run_tests.sh"  # how the tests are meant to be started


def bind_test_kernels(platform: str = sys.platform) -> tuple[str, str]:
    """Bind the native kernels as servers and workers do at start.

    Returns:
        (path, problem): which arithmetic this run tests, and "" or why the run must not go on
        (on Linux: any kernel that did not bind; elsewhere nothing is required).
    """
    why_not = enable_native_kernels()
    products = load_quant_kernel() if not why_not else why_not
    if not why_not and not isinstance(products, str):
        return "native kernels (attention and whole block, exact-gemm products)", ""
    reason = why_not or products
    if not platform.startswith("linux"):
        return f"MLX ops ({reason})", ""
    path = "native attention, MLX-ops blocks" if not why_not else "MLX ops"
    return path, (f"the native kernels did not bind ({reason}); the exactness batteries would test the MLX-ops "
                  f"path instead. Install a C and C++ compiler (apt-get install g++) and run `{RUN_TESTS}`")


def is_kernel_bound() -> bool:
    """The exact-gemm kernel computes this process's products (its primitives; rows invariant by construction)."""
    bound = native_kernels.bound()
    return bound is not None and bound.matmul is not None


def assert_full_tile(engine: Engine) -> Engine:
    """Check that `engine` is exact and, where the exact-gemm kernel is bound, probed at its configured maximum tile.

    A probe that shrank the tile (to 1, say) would run every chunking as the same computation and
    make every equality trivially true. Returns the engine, so fixtures can wrap its construction.
    """
    try:
        assert engine.is_exact and engine.probe is not None, "the engine is not on the exact path"
        wanted = engine.probe.max_candidate
        if is_kernel_bound():
            assert engine.block == wanted, (f"the tile probe chose block {engine.block}, not the configured {wanted}, "
                                            f"under the exact-gemm kernel: {list(engine.probe.failures)[:3]}")
        else:  # MLX's own BLAS (macOS): whatever the probe found, but more than single rows
            assert engine.block >= 2, f"the tile probe chose block {engine.block}: chunkings would not differ"
    except AssertionError:
        engine.close()  # a fixture that fails here never reaches its teardown
        raise
    return engine


def tiny_drafted_engine(model) -> Engine:
    """The exact engine the tiny-model server batteries share: tile 16 (checked), block 64, rollback 8,
    a random tiny draft model."""
    from tests.tiny_models import random_model

    return assert_full_tile(Engine(model, exact=True, max_tile=16, plain_block=64, max_rollback=8,
                                   draft=random_model(seed=1)))
