"""Fast BLAS for MLX on Linux: find Debian's OpenBLAS, preload it, and report what is active.

MLX's Linux CPU wheel links a slow reference BLAS; interposing OpenBLAS through
LD_PRELOAD (set before MLX loads) makes matmuls ~40x faster. Only the launcher calls
`reexec_with_openblas`; on macOS nothing happens (MLX uses Accelerate/Metal).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_REEXEC_MARK = "INFERENCE_ENGINE_BLAS_REEXEC"


def find_openblas() -> str | None:
    """Path of a system OpenBLAS that can be interposed, if installed."""
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).is_file()), None)


def reexec_with_openblas(argv: list[str]) -> None:
    """Re-exec this Python process once with OpenBLAS preloaded (Linux only).

    Returns normally (no re-exec) on non-Linux systems, when it is already preloaded,
    when no OpenBLAS is installed, or when INFERENCE_ENGINE_NO_OPENBLAS=1.
    """
    if not sys.platform.startswith("linux") or os.environ.get("INFERENCE_ENGINE_NO_OPENBLAS") == "1":
        return
    lib = find_openblas()
    preload = os.environ.get("LD_PRELOAD", "")
    if lib is None or "openblas" in preload or os.environ.get(_REEXEC_MARK):
        return
    env = dict(os.environ, LD_PRELOAD=f"{lib}:{preload}" if preload else lib, **{_REEXEC_MARK: "1"})
    os.execve(sys.executable, [sys.executable, *argv], env)


def active_blas() -> str:
    """Which BLAS library this process has mapped ('openblas: PATH', 'accelerate', 'reference')."""
    if sys.platform == "darwin":
        return "accelerate (macOS)"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    libs = sorted({line.split()[-1] for line in maps.splitlines() if "blas" in line.lower() and "/" in line})
    openblas = [lib for lib in libs if "openblas" in lib]
    if openblas:
        return f"openblas: {openblas[0]}"
    return f"reference: {', '.join(libs) or 'bundled'}"
