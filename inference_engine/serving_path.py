"""Which arithmetic serves this process: the exact kernels on MLX's CPU stream, or MLX ops (CPU or Metal).

One string names it everywhere the bits must agree (GetModelInfo's `kernels`, the start-up log,
snapshot fingerprints, a shard route's check): the exact kernels' own version when they compute
every product, so a process started with or without the launcher's OpenBLAS preload reports
the same (its bits are the same); otherwise "MLX ops" and what MLX computes with.

On macOS an exact server computes on MLX's CPU stream (`use_cpu_stream`); Metal serves plain
(MLX on Metal is not batch-invariant beyond small tiles, and the exact kernels have no GPU code).
"""

from __future__ import annotations

import logging
import sys

import mlx.core as mx

from inference_engine.blas import active_blas
from inference_engine.model import native_kernels
from inference_engine.quant_kernel import loaded_kernel

log = logging.getLogger(__name__)
EXACT_SUFFIX = " on MLX's CPU stream"  # ends the exact kernels' description


def kernels_in_use() -> str:
    """What computes this process's products, e.g. "exact-gemm kernel 3 (...) on MLX's CPU stream",
    "MLX ops (native attention), BLAS openblas: PATH" or "MLX ops on Metal"."""
    bound = native_kernels.bound()
    kernel = loaded_kernel()
    if bound is not None and bound.matmul is not None and kernel is not None:
        return kernel.version + EXACT_SUFFIX
    if mx.default_device() != mx.cpu:
        return "MLX ops on Metal"
    return f"MLX ops{' (native attention)' if bound is not None else ''}, BLAS {active_blas()}"


def is_exact_native() -> bool:
    """Every product of this process is computed by the exact kernels (not MLX's matmul)."""
    return kernels_in_use().endswith(EXACT_SUFFIX)


def use_cpu_stream(exact: bool, platform: str = sys.platform) -> None:
    """On macOS, make MLX's CPU the default device for an exact server (the exact kernels run there);
    a plain server stays on Metal. Elsewhere MLX computes on the CPU already. Call before loading."""
    if platform == "darwin" and exact and mx.default_device() != mx.cpu:
        mx.set_default_device(mx.cpu)
        log.info("exact mode: MLX computes on its CPU stream (the exact kernels); Metal serves plain mode only")
