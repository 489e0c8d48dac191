"""The exact kernels: an MLX extension whose primitives compute every exact product (Linux, macOS).

`native/exact_quant.cpp` defines MLX primitives whose CPU implementations call the exact-gemm
library (`native/exact_gemm.c`): `matmul(x, w)` = x @ W.T for fp32 W (`exact_sgemm_nt`,
`native/exact_matmul.cpp`) and `qmatmul(x, blocks, fmt)` for W in GGUF blocks (`exact_qgemm`),
one dot-product code and one thread pool, so a quantized product is bitwise the fp32 product
of the dequantized weights. The library is dlopen()ed by path: no LD_PRELOAD and no re-exec
(the launcher's OpenBLAS preload, `blas.py`, only speeds up MLX's own, non-exact matmuls).

Built once with the system compilers (gcc or clang on Linux, Apple clang on macOS) against the
mlx wheel's headers and nanobind (a pinned PyPI package) into `<cache>/native/`, named by the
hash of everything that goes into it. The macOS branch (`_platform_flags`: -undefined
dynamic_lookup for Python's symbols, no OpenMP anywhere) is written but has not been built on a
Mac. Where it cannot be built `load_quant_kernel` says why, and the process computes with MLX ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from inference_engine.blas import INTERPOSERS, build_kernel
from inference_engine.model import native_kernels

log = logging.getLogger(__name__)
_NATIVE = Path(__file__).resolve().parent / "native"
MODULE = "_exact_quant"  # the extension's import name (NB_MODULE)
KERNEL = "exact_gemm"  # the library whose exact_sgemm_nt / exact_qgemm the extension calls
PLATFORMS = ("linux", "darwin")  # where the extension is built (darwin: written, not yet built on a Mac)
CXX_FLAGS = ("-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off")  # no FMA: the native blocks


@dataclass(frozen=True)
class QuantKernel:
    """The loaded extension, bound to the exact-gemm library."""

    qmatmul: Callable  # (x float32 (..., K), blocks uint8 (N, bytes), fmt) -> float32 (..., N)
    matmul: Callable  # (x float32 (..., K), w float32 (N, K)) -> float32 (..., N): the fp32 exact product
    library: str  # path of the exact-gemm library it computes with
    version: str  # the library's exact_gemm_version, e.g. "exact-gemm kernel 3 (max rows 64, ...)"
    extension: str  # path of the compiled extension


def _toolchain() -> tuple[Path, Path, str] | str:
    """(nanobind package dir, mlx package dir, python include dir), or why they are missing."""
    try:
        import mlx.core
        import nanobind
    except ImportError as exc:
        return f"cannot import {exc.name} (pip install 'inference_engine[server]', which pins it)"
    # mlx is a namespace package: mlx.__path__ may start with a folder named mlx in the current
    # directory (MLX's own cache folder, say). Its headers are next to the compiled mlx.core.
    mlx_dir = Path(mlx.core.__file__).resolve().parent
    if not (mlx_dir / "include" / "mlx" / "mlx.h").is_file():
        return f"the mlx wheel at {mlx_dir} ships no C++ headers"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        return f"no Python headers at {include}"
    return Path(nanobind.__file__).parent, mlx_dir, include


def extension_path(cache_dir: Path | None = None) -> Path | str:
    """Path of the compiled extension, building it on first use; or why it cannot be built.

    Built with $CXX (default `c++`): nanobind's own sources and native/exact_quant.cpp, linked
    against the wheel's libmlx, into <cache>/native/exact_quant-<hash>/, the hash covering the
    sources, the flags and the mlx, nanobind and Python versions.
    """
    found = _toolchain()
    if isinstance(found, str):
        return found
    nb_dir, mlx_dir, py_include = found
    if cache_dir is None:
        from inference_engine.config import default_cache_dir

        cache_dir = default_cache_dir()
    sources = [_NATIVE / "exact_quant.cpp", _NATIVE / "exact_attention.cpp", _NATIVE / "exact_layer.cpp",
               _NATIVE / "exact_matmul.cpp"]
    missing = [f.name for f in sources if not f.is_file()]
    if missing:
        return f"{', '.join(missing)} missing from {_NATIVE} (an incomplete install: reinstall inference_engine)"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    import mlx.core as mx
    import nanobind

    key = b"".join([*(f.read_bytes() for f in (*sources, *_NATIVE.glob("*.h"))), " ".join(CXX_FLAGS).encode(), mx.__version__.encode(),
                    nanobind.__version__.encode(), sys.version.encode(), str(mlx_dir).encode()])
    target = cache_dir / "native" / f"exact_quant-{hashlib.sha256(key).hexdigest()[:12]}" / f"{MODULE}{suffix}"
    if target.is_file():
        return target
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')}; apt-get install g++, or set $CXX)"
    log.info("building the exact kernel extension into %s (first use; about a minute)", target.parent)
    work = target.parent.with_name(f"{target.parent.name}.{os.getpid()}.partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    includes = [f"-I{nb_dir / 'include'}", f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}", f"-I{py_include}"]
    compiles = [  # nanobind's runtime (NB_BUILD), then the module in MLX's nanobind domain (shares mx.array)
        [cxx, *CXX_FLAGS, "-fno-strict-aliasing", "-DNB_BUILD", *includes, "-c", str(nb_dir / "src" / "nb_combined.cpp"),
         "-o", str(work / "nb.o")],
        *([cxx, *CXX_FLAGS, "-DNB_DOMAIN=mlx", *includes, f"-I{mlx_dir / 'include'}", "-c", str(src),
           "-o", str(work / f"{src.stem}.o")] for src in sources),
    ]
    objects = [work / f"{src.stem}.o" for src in sources]
    link = [cxx, "-shared", "-o", str(work / target.name), *map(str, objects), str(work / "nb.o"),
            f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}", *_platform_flags(sys.platform)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), compiles))
    if all(r.returncode == 0 for r in results):
        results.append(subprocess.run(link, capture_output=True, text=True))
    failed = [r for r in results if r.returncode != 0]
    if failed:
        shutil.rmtree(work, ignore_errors=True)
        return f"building the extension with {cxx} failed:\n{failed[0].stderr.strip()[-4000:]}"
    for leftover in (work / "nb.o", *objects):
        leftover.unlink()
    try:
        work.rename(target.parent)  # atomic: a concurrent build that won leaves its own copy in place
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _import(path: Path) -> ModuleType:
    if str(path) in _MODULES:  # an extension module is loaded once per process
        return _MODULES[str(path)]
    spec = importlib.util.spec_from_file_location(MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _MODULES[str(path)] = module
    return module


_MODULES: dict[str, ModuleType] = {}
_LOADED: dict[str, QuantKernel] = {}  # one binding per process: the extension module is process-global


def _platform_flags(platform: str) -> list[str]:
    """Link flags of the extension on `platform`: macOS resolves Python's symbols when the module is
    imported (an extension links no libpython); Linux's linker allows undefined symbols in a shared
    object already. Neither needs OpenMP: the library's pool is plain pthreads."""
    return ["-undefined", "dynamic_lookup"] if platform == "darwin" else []


def load_quant_kernel(cache_dir: Path | None = None) -> QuantKernel | str:
    """The extension bound to the exact-gemm library, or why the exact kernels cannot compute here.

    The library is loaded by path (dlopen), preloaded or not. Returns a reason (str) when the
    platform is not one of PLATFORMS, or the library or the extension cannot be built.
    """
    if not sys.platform.startswith(PLATFORMS):
        return f"the exact kernels are built for Linux and macOS; this is {sys.platform}"
    built = build_kernel(KERNEL, cache_dir)
    if not isinstance(built, Path):
        return f"the {INTERPOSERS[KERNEL].label} cannot be built: {built}"
    library = str(built)
    if library in _LOADED:
        return _LOADED[library]
    path = extension_path(cache_dir)
    if isinstance(path, str):
        return path
    module = _import(path)
    module.bind_kernel(library)
    symbol = ctypes.c_char.in_dll(ctypes.CDLL(library), INTERPOSERS[KERNEL].version_symbol)  # the same copy
    version = ctypes.string_at(ctypes.addressof(symbol)).decode()
    _LOADED[library] = QuantKernel(module.qmatmul, module.matmul, library, version, str(path))
    return _LOADED[library]


def loaded_kernel() -> QuantKernel | None:
    """The kernel this process loaded, if any (one per process)."""
    return next(iter(_LOADED.values()), None)


def exact_kernels_built(cache_dir: Path | None = None) -> bool:
    """The exact-gemm library and the extension are built (building them now on first use): the
    launcher then needs no OpenBLAS re-exec, since they compute every product."""
    return isinstance(build_kernel(KERNEL, cache_dir), Path) and isinstance(extension_path(cache_dir), Path)


def enable_native_kernels(cache_dir: Path | None = None) -> str:
    """Bind the native kernels (model/native_kernels.py) in this process where MLX computes on
    the CPU (Linux, or macOS after `use_cpu_stream`) and the extension builds; returns why not
    ("" when bound). The whole block and the fp32 product primitive come with them where the
    exact-gemm library loads, attention alone elsewhere.

    Call before the first forward; every process of one deployment decides the same way.
    """
    import mlx.core as mx

    if native_kernels.is_bound():
        return ""
    if not sys.platform.startswith(PLATFORMS):
        return f"the native kernels are built for Linux and macOS; this is {sys.platform}"
    if mx.default_device() != mx.cpu:
        return f"the native kernels run on MLX's CPU stream; MLX computes on {mx.default_device()}"
    path = extension_path(cache_dir)
    if isinstance(path, str):
        return path
    try:
        module = _import(path)
        products = load_quant_kernel(cache_dir)  # binds the extension to the exact-gemm library
        block, matmul = (None, None) if isinstance(products, str) else (module.block, products.matmul)
        native_kernels.bind(native_kernels.NativeKernels(module.attend, block, matmul))
    except RuntimeError as exc:  # a forward already ran here with MLX ops: keep them
        return str(exc)
    return ""


if __name__ == "__main__":  # `python -m inference_engine.quant_kernel`: build now (scripts/dev.sh setup)
    built = extension_path()
    if isinstance(built, str):
        sys.exit(f"note: the exact kernel extension is unavailable ({built}); servers will compute with MLX ops")
    print(built)
