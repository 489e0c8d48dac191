"""Fast BLAS for MLX on Linux: find Debian's OpenBLAS, preload it, and report what is active.

MLX's Linux CPU wheel links a slow reference BLAS; interposing OpenBLAS through
LD_PRELOAD (set before MLX loads) makes matmuls ~40x faster. In front of it goes the
row-gemv interposer (native/row_gemv.c, compiled once with the system C compiler into the
cache folder): calls of at most 16 rows run one sgemv per row, 2x faster for decode and
row-invariant by construction. Only the launcher calls `reexec_with_openblas`; on macOS
nothing happens (MLX uses Accelerate/Metal).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_REEXEC_MARK = "INFERENCE_ENGINE_BLAS_REEXEC"
_ROW_GEMV_SOURCE = Path(__file__).resolve().parent / "native" / "row_gemv.c"
ROW_GEMV_TAG = "row_gemv"  # file-name prefix of the compiled interposer (what active_blas looks for)


def find_openblas() -> str | None:
    """Path of a system OpenBLAS that can be interposed, if installed."""
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).is_file()), None)


def row_gemv_library(cache_dir: Path | None = None) -> str | None:
    """Path of the compiled row-gemv interposer, building it on first use.

    Built with $CC (default `cc`) into <cache>/native/, named by the source's hash so an
    edited source is rebuilt. Returns None (the caller then preloads OpenBLAS alone) when
    INFERENCE_ENGINE_NO_ROW_GEMV=1 or no compiler is available or the build fails.
    """
    if os.environ.get("INFERENCE_ENGINE_NO_ROW_GEMV") == "1":
        return None
    if cache_dir is None:
        from inference_engine.config import default_cache_dir

        cache_dir = default_cache_dir()
    source = _ROW_GEMV_SOURCE.read_bytes()
    target = cache_dir / "native" / f"{ROW_GEMV_TAG}-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if target.is_file():
        return str(target)
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        print(f"note: no C compiler ({os.environ.get('CC', 'cc')}); running without the row-gemv interposer",
              file=sys.stderr)
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    cmd = [cc, "-O2", "-fPIC", "-shared", "-o", str(partial), str(_ROW_GEMV_SOURCE), "-ldl"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"note: building the row-gemv interposer failed; running without it:\n{result.stderr}", file=sys.stderr)
        partial.unlink(missing_ok=True)
        return None
    partial.replace(target)  # atomic: concurrent launchers never load a half-written file
    return str(target)


def preload_libraries() -> list[str]:
    """What the launcher puts in LD_PRELOAD, in order: [row-gemv interposer,] OpenBLAS; [] if none."""
    lib = find_openblas()
    if lib is None:
        return []
    interposer = row_gemv_library()
    return [interposer, lib] if interposer else [lib]


def reexec_with_openblas(argv: list[str]) -> None:
    """Re-exec this Python process once with OpenBLAS (and the interposer) preloaded (Linux only).

    Returns normally (no re-exec) on non-Linux systems, when OpenBLAS is already preloaded,
    when no OpenBLAS is installed, or when INFERENCE_ENGINE_NO_OPENBLAS=1.
    """
    if not sys.platform.startswith("linux") or os.environ.get("INFERENCE_ENGINE_NO_OPENBLAS") == "1":
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "openblas" in preload or os.environ.get(_REEXEC_MARK):
        return
    libs = preload_libraries()
    if not libs:
        return
    env = dict(os.environ, LD_PRELOAD=":".join([*libs, preload] if preload else libs), **{_REEXEC_MARK: "1"})
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
    interposer = any(f"/{ROW_GEMV_TAG}-" in line for line in maps.splitlines())
    if openblas:
        return f"openblas: {openblas[0]}" + (" + row-gemv interposer" if interposer else "")
    return f"reference: {', '.join(libs) or 'bundled'}"


if __name__ == "__main__":  # `python -m inference_engine.blas`: the LD_PRELOAD value scripts use
    print(":".join(preload_libraries()) if sys.platform.startswith("linux") else "")
