"""The native kernels' harness (tests/native/kernel_harness.cpp): build, run, compare.

Every kernel variant (x86-64 AVX-512, AVX2+FMA, portable; arm64 NEON and portable under
qemu-user) must print the same tensor digests as every other: that is the cross-CPU promise
(README "Exactness"). `scripts/check_arm64.sh` runs `python3 -m tests.kernel_harness --arm64`;
tests/test_golden_digests.py compares the x86-64 variants with tests/golden/digests.json.
Standard library only, so the script runs without the project's virtualenv.

Usage: python3 -m tests.kernel_harness [--arm64]   (prints one line per variant; exit 1 when
one differs from tests/golden/digests.json's tensors, or from the first variant's without a table;
2 when a variant could not be built or run)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "inference_engine" / "native"
HARNESS = ROOT / "tests" / "native" / "kernel_harness.cpp"
C_FLAGS = ("-O3", "-ffp-contract=off", "-Wno-psabi")  # exact_gemm.c's flags as blas.py builds it
CXX_FLAGS = ("-std=c++20", "-O2", "-ffp-contract=off", "-Wno-psabi")  # quant_kernel.py's
LIBS = ("-lpthread", "-ldl", "-lm")
QEMU_SYSROOT = "/usr/aarch64-linux-gnu"
GOLDEN = ROOT / "tests" / "golden" / "digests.json"  # tests/golden_digests.py


@dataclass(frozen=True)
class Variant:
    """One way of running the kernels."""

    name: str  # as the report and digests.json name it
    arch: str  # "x86_64" or "aarch64" (the build it runs)
    env: tuple[tuple[str, str], ...]  # what selects it (EXACT_GEMM_*)
    expect: str  # the harness's first line for it: "variant <gemm loops> / <vector math>"


X86_VARIANTS = (
    Variant("x86-64 AVX-512", "x86_64", (), "variant x86-64 AVX-512 / x86-64 AVX2"),
    Variant("x86-64 AVX2+FMA", "x86_64", (("EXACT_GEMM_NO_AVX512", "1"),), "variant x86-64 AVX2+FMA / x86-64 AVX2"),
    Variant("x86-64 portable", "x86_64", (("EXACT_GEMM_PORTABLE", "1"),), "variant portable / portable"),
)
ARM64_VARIANTS = (
    Variant("arm64 NEON (qemu)", "aarch64", (), "variant arm64 NEON / arm64 NEON"),
    Variant("arm64 portable (qemu)", "aarch64", (("EXACT_GEMM_PORTABLE", "1"),), "variant portable / portable"),
)


class HarnessError(RuntimeError):
    """A harness could not be built or run (a missing compiler, emulator or CPU feature)."""


def cache_dir() -> Path:
    """Where built harnesses live: $INFERENCE_ENGINE_CACHE or ~/.cache/inference_engine (config.py's)."""
    env = os.environ.get("INFERENCE_ENGINE_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "inference_engine") / "native"


def compilers(arch: str) -> tuple[str, str]:
    """(C compiler, C++ compiler) for `arch`: the host's $CC/$CXX, or Debian's aarch64 cross compilers."""
    if arch == "aarch64" and platform.machine() != "aarch64":
        return "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++"
    return os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")


def build(arch: str, gemm: Path | None = None) -> Path:
    """The harness for `arch`, built once per source, flag and compiler version (by their hash).

    `gemm`: the server's own exact-gemm library (blas.build_kernel's, the one it preloads) to
    link instead of compiling exact_gemm.c again (x86-64 only); the harness then runs its bits.

    Raises:
        HarnessError: a compiler is missing or a build failed (its output in the message).
    """
    cc, cxx = compilers(arch)
    for tool in (cc, cxx):
        if shutil.which(tool) is None:
            raise HarnessError(f"no {tool} (apt-get install {'g++-aarch64-linux-gnu' if arch == 'aarch64' else 'g++'})")
    versions = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = b"".join([*(p.read_bytes() for p in sorted(NATIVE.glob("*.h"))), (NATIVE / "exact_gemm.c").read_bytes(),
                    HARNESS.read_bytes(), " ".join(C_FLAGS + CXX_FLAGS).encode(), versions.encode(),
                    str(gemm).encode()])
    target = cache_dir() / f"kernel-harness-{arch}-{hashlib.sha256(key).hexdigest()[:12]}"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    obj, main_obj, partial = (target.with_suffix(s) for s in (".gemm.o.partial", ".main.o.partial", ".partial"))
    compiles = [[cxx, "-c", *CXX_FLAGS, f"-I{NATIVE}", str(HARNESS), "-o", str(main_obj)]]
    if gemm is None:  # both objects at once: a cold arm64 build is ~45 s of -O3 on exact_gemm.c alone
        compiles.append([cc, "-c", str(NATIVE / "exact_gemm.c"), "-o", str(obj), *C_FLAGS])
    running = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for cmd in compiles]
    for cmd, proc in running:
        err = proc.communicate()[1]
        if proc.returncode != 0:
            raise HarnessError(f"{' '.join(cmd[:4])} ... failed:\n{err[-4000:]}")
    link = [cxx, str(main_obj), str(obj) if gemm is None else str(gemm), "-o", str(partial), *LIBS]
    if gemm is not None:  # the server's library, found at run time where it lies
        link.insert(-len(LIBS), f"-Wl,-rpath,{gemm.parent}")
    done = subprocess.run(link, capture_output=True, text=True)
    if done.returncode != 0:
        raise HarnessError(f"linking the harness failed:\n{done.stderr[-4000:]}")
    partial.replace(target)
    obj.unlink(missing_ok=True)
    main_obj.unlink(missing_ok=True)
    return target


def run(variant: Variant, binary: Path) -> list[str]:
    """The harness's tensor lines for `variant` ("<name> <elements> <fnv64>"), after checking its first line.

    Raises:
        HarnessError: it failed, or ran another variant than asked (a CPU without AVX-512, say).
    """
    cmd = [str(binary)]
    if variant.arch == "aarch64" and platform.machine() != "aarch64":  # emulated; natively on an arm64 host
        qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
        if qemu is None:
            raise HarnessError("no qemu-aarch64-static (apt-get install qemu-user-static)")
        cmd = [qemu, "-L", QEMU_SYSROOT, *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXACT_GEMM_") and k != "LD_PRELOAD"}
    env.update(dict(variant.env))
    env["EXACT_GEMM_NUM_THREADS"] = "2"  # the pool runs (any thread count gives the same bits)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise HarnessError(f"{variant.name}: the harness exited {done.returncode}: {done.stderr[-2000:]}")
    first, *lines = done.stdout.splitlines()
    if first != variant.expect:
        raise HarnessError(f"{variant.name}: ran {first!r} (this CPU lacks it?), expected {variant.expect!r}")
    return lines


def tensors(lines: list[str]) -> dict[str, str]:
    """{tensor name: "<elements> <fnv64>"} from the harness's lines."""
    return dict(line.split(" ", 1) for line in lines)


def digest(lines: list[str]) -> str:
    """One sha256 over every tensor line: equal digests, equal bits of every output."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def first_difference(expected: dict[str, str], got: dict[str, str]) -> str | None:
    """The first tensor (in `expected`'s order) whose digest differs or is missing, or None."""
    for name, value in expected.items():
        if got.get(name) != value:
            return f"{name}: expected {value}, got {got.get(name, 'nothing')}"
    extra = [name for name in got if name not in expected]
    return f"{extra[0]}: not in the reference" if extra else None


def server_library() -> Path | None:
    """The exact-gemm library the server preloads on this machine (built if need be), or None."""
    if platform.machine() != "x86_64":
        return None
    from inference_engine.blas import build_kernel  # standard library only, like this module

    library = build_kernel("exact_gemm", cache_dir().parent)
    return library if isinstance(library, Path) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm64", action="store_true", help="also the arm64 build under qemu-aarch64")
    args = parser.parse_args(argv)
    variants = (X86_VARIANTS if platform.machine() == "x86_64" else ()) + (ARM64_VARIANTS if args.arm64 else ())
    reference: tuple[str, dict[str, str]] | None = None
    if GOLDEN.is_file():  # the committed bits first: a change every variant shares is caught too
        reference = ("the golden table", json.loads(GOLDEN.read_text())["kernels"]["tensors"])
    status = 0
    gemm = server_library()
    for variant in variants:
        try:
            got = tensors(run(variant, build(variant.arch, gemm if variant.arch == "x86_64" else None)))
        except HarnessError as exc:
            print(f"{variant.name:24} NOT RUN: {exc}", flush=True)
            status = max(status, 2)
            continue
        if reference is None:
            reference = (variant.name, got)
        diff = first_difference(reference[1], got)
        same = f"same bits as {reference[0]}" if variant.name != reference[0] else "reference"
        print(f"{variant.name:24} {len(got)} tensors, digest {digest([f'{k} {v}' for k, v in got.items()])[:16]}: "
              f"{'DIFFERS at ' + diff if diff else same}", flush=True)
        if diff:
            status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
