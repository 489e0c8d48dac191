"""The exact-gemm library's build, and OpenBLAS for MLX's own matmuls where the exact kernels are missing.

Every exact product is computed by the exact kernels' MLX primitives (quant_kernel.py), which
dlopen the exact-gemm library built here (native/exact_gemm.c): no LD_PRELOAD is needed, and the
launcher does not re-exec where they are built (measured: results/preload_bench.json; with them
bound no product goes through MLX's matmul, so a preloaded OpenBLAS changes neither speed nor bits).

Where they cannot be built (no C++ compiler), blocks run as MLX ops on MLX's own matmul, and the
Linux CPU wheel links a slow reference BLAS: the launcher then re-execs once with OpenBLAS
preloaded through LD_PRELOAD (~40x faster matmuls), INFERENCE_ENGINE_OPENBLAS=1 forces that
re-exec anyway (benchmarks). In front of OpenBLAS goes a cblas_sgemm kernel compiled once with the
system C compiler into the cache folder, chosen by INFERENCE_ENGINE_KERNEL (read here only):
- exact_gemm (default, native/exact_gemm.c): calls of at most 64 rows computed by a
  kernel whose rows are bitwise independent of their block by construction, each weight
  read once per call;
- row_gemv (native/row_gemv.c): calls of at most 16 rows run one OpenBLAS sgemv per row;
- openblas (or INFERENCE_ENGINE_NO_ROW_GEMV=1): OpenBLAS alone (row-invariant up to ~12 rows).
Only the launcher calls `reexec_with_openblas`; on macOS nothing happens (MLX uses
Accelerate/Metal).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_REEXEC_MARK = "INFERENCE_ENGINE_BLAS_REEXEC"
FORCE_ENV = "INFERENCE_ENGINE_OPENBLAS"  # "1": re-exec with OpenBLAS even where the exact kernels are built
_NATIVE = Path(__file__).resolve().parent / "native"
KERNEL_ENV = "INFERENCE_ENGINE_KERNEL"  # which cblas_sgemm goes in front of OpenBLAS (read here only)
DEFAULT_KERNEL = "exact_gemm"


@dataclass(frozen=True)
class Interposer:
    """A cblas_sgemm interposer compiled from native/<name>.c and preloaded before OpenBLAS."""

    name: str  # file-name prefix of source and library
    flags: tuple[str, ...]  # compiler flags besides -fPIC -shared (part of the library's hash)
    label: str  # how build notes name it
    version_symbol: str  # exported version string: in the global scope only when preloaded
    reports_version: bool  # active_blas names it by its version string (else by its label)


INTERPOSERS = {
    # -ffp-contract=off: no multiply and add fused implicitly; the kernel's steps are explicit
    # fused multiply-adds (fmaf: -lm where no FMA instruction is built in; see the source).
    "exact_gemm": Interposer("exact_gemm", ("-O3", "-ffp-contract=off", "-lpthread", "-ldl", "-lm"), "exact-gemm kernel",
                             "exact_gemm_version", reports_version=True),
    "row_gemv": Interposer("row_gemv", ("-O2", "-ldl"), "row-gemv interposer", "row_gemv_version",
                           reports_version=False),
}
KERNELS = (*INTERPOSERS, "openblas")  # the choices of INFERENCE_ENGINE_KERNEL


def find_openblas() -> str | None:
    """Path of a system OpenBLAS that can be interposed, if installed."""
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).is_file()), None)


def selected_kernel() -> str:
    """The kernel in front of OpenBLAS: $INFERENCE_ENGINE_KERNEL, default exact_gemm.

    INFERENCE_ENGINE_NO_ROW_GEMV=1 (the older switch) means openblas.

    Raises:
        ValueError: INFERENCE_ENGINE_KERNEL names no known kernel.
    """
    if os.environ.get("INFERENCE_ENGINE_NO_ROW_GEMV") == "1":
        return "openblas"
    kernel = os.environ.get(KERNEL_ENV) or DEFAULT_KERNEL
    if kernel not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={kernel!r} is not a kernel; choose one of {', '.join(KERNELS)}")
    return kernel


def kernel_library(kernel: str, cache_dir: Path | None = None) -> str | None:
    """Path of the compiled interposer `kernel`, building it on first use.

    Built with $CC (default `cc`) into <cache>/native/, named by the hash of source and
    flags so an edited source is rebuilt. Returns None (the caller then preloads OpenBLAS
    alone) for "openblas", or when no compiler is available or the build fails (a WARNING on
    stderr names the cause).
    """
    library = build_kernel(kernel, cache_dir)
    if library is None or isinstance(library, Path):
        return None if library is None else str(library)
    print(f"WARNING: running without the {INTERPOSERS[kernel].label}: {library}", file=sys.stderr)
    return None


def build_kernel(kernel: str, cache_dir: Path | None = None) -> Path | str | None:
    """The compiled interposer `kernel` (built on first use), why it cannot be built (str), or None for "openblas"."""
    if kernel not in INTERPOSERS:
        return None
    spec = INTERPOSERS[kernel]
    if cache_dir is None:
        from inference_engine.config import default_cache_dir

        cache_dir = default_cache_dir()
    source = _NATIVE / f"{spec.name}.c"
    if not source.is_file():
        return f"its source {source} is missing from the installed package (reinstall inference_engine)"
    headers = b"".join(h.read_bytes() for h in sorted(_NATIVE.glob("*.h")))  # what the sources include
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(spec.flags).encode()).hexdigest()[:12]
    target = cache_dir / "native" / f"{spec.name}-{digest}.so"
    if target.is_file():
        return target
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')}; apt-get install gcc libc6-dev, or set $CC)"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    cmd = [cc, "-fPIC", "-shared", "-o", str(partial), str(source), *spec.flags]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        return f"building it with {cc} failed (exit {result.returncode}):\n{result.stderr.strip()[-4000:]}"
    partial.replace(target)  # atomic: concurrent launchers never load a half-written file
    return target


def interposer_library(cache_dir: Path | None = None) -> str | None:
    """The selected kernel's compiled interposer (None: OpenBLAS alone)."""
    return kernel_library(selected_kernel(), cache_dir)


def preload_libraries() -> list[str]:
    """What the launcher puts in LD_PRELOAD, in order: [kernel interposer,] OpenBLAS; [] if none."""
    lib = find_openblas()
    if lib is None:
        return []
    interposer = interposer_library()
    return [interposer, lib] if interposer else [lib]


def reexec_with_openblas(argv: list[str], base_env: dict[str, str] | None = None) -> None:
    """Re-exec this Python process once with OpenBLAS (and the selected kernel) preloaded (Linux only).

    Args:
        argv: the new process's arguments after the interpreter (e.g. launch.module_command's).
        base_env: its environment before LD_PRELOAD is added (default os.environ).

    Returns normally (no re-exec) on non-Linux systems, when OpenBLAS is already preloaded,
    when no OpenBLAS is installed, or when INFERENCE_ENGINE_NO_OPENBLAS=1. The launcher calls it
    only where the exact kernels are not built, or INFERENCE_ENGINE_OPENBLAS=1 (`__main__`).

    Raises:
        ValueError: INFERENCE_ENGINE_KERNEL names no known kernel.
    """
    if not sys.platform.startswith("linux") or os.environ.get("INFERENCE_ENGINE_NO_OPENBLAS") == "1":
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "openblas" in preload or os.environ.get(_REEXEC_MARK):
        return
    libs = preload_libraries()
    if not libs:
        return
    env = dict(os.environ if base_env is None else base_env, **{_REEXEC_MARK: "1"})
    env["LD_PRELOAD"] = ":".join([*libs, preload] if preload else libs)
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
    # numpy's bundled libscipy_openblas64_ exports prefixed symbols: it computes numpy's products, not
    # MLX's. The one in use is the preloaded one, else any other OpenBLAS mapped.
    preloaded = os.environ.get("LD_PRELOAD", "").split(":")
    openblas = sorted((lib for lib in libs if "openblas" in lib and "scipy_openblas" not in lib),
                      key=lambda lib: not any(lib == p or Path(lib).name == Path(p).name for p in preloaded if p))
    if not openblas:
        others = [lib for lib in libs if "scipy_openblas" not in lib]
        return f"reference: {', '.join(others) or 'MLX bundled'}"
    front = next(filter(None, map(_preloaded_version, INTERPOSERS.values())), "")
    return f"openblas: {openblas[0]}" + (f" + {front}" if front else "")


def _preloaded_version(spec: Interposer) -> str | None:
    """How active_blas names `spec` if it is preloaded (its symbols are global), else None.

    A copy loaded privately (ctypes, a test) is mapped but computes nobody's matmuls.
    """
    try:
        version = ctypes.c_char.in_dll(ctypes.CDLL(None), spec.version_symbol)
    except ValueError:
        return None
    return ctypes.string_at(ctypes.addressof(version)).decode() if spec.reports_version else spec.label


if __name__ == "__main__":  # `python -m inference_engine.blas`: the LD_PRELOAD value scripts use
    try:
        print(":".join(preload_libraries()) if sys.platform.startswith("linux") else "")
    except ValueError as exc:
        sys.exit(f"error: {exc}")
