"""Which BLAS arrangement the tests run under (the OpenBLAS preload is Linux-only)."""

import sys

import pytest

from inference_engine.blas import find_openblas

# The OpenBLAS preload (and the row-gemv interposer) are the Linux launcher's arrangement; on
# macOS MLX runs on Accelerate/Metal and tests about that arrangement are skipped.
HAS_LINUX_OPENBLAS = sys.platform.startswith("linux") and find_openblas() is not None
linux_openblas = pytest.mark.skipif(not HAS_LINUX_OPENBLAS, reason="Linux OpenBLAS launcher arrangement")
EXPECTED_BLAS = "openblas" if HAS_LINUX_OPENBLAS else "accelerate"  # what `active_blas()` starts with
