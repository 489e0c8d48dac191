"""The committed golden digests (tests/golden_digests.py) on whatever CPU runs the tests.

Kernels: the harness, linked against the very exact-gemm library the server loads, run as
every x86-64 variant this CPU has; each must give the committed per-tensor digests (the arm64
ones, checked under qemu by scripts/check_arm64.sh, are in the same table). A mismatch names the
variant and the first differing tensor. Model: the packaged SmolLM2 served as q4_1, fixed feeds
in several chunkings: the committed state_digest, 32 greedy and 32 seeded tokens.
"""

from __future__ import annotations

import platform
import sys

import pytest

from inference_engine.blas import build_kernel
from inference_engine.server.server import build_engine, engine_weights
from tests import golden_digests, kernel_harness
from tests.conftest import make_config

GOLDEN = golden_digests.load()
KERNELS = GOLDEN["kernels"]


def test_table_holds_every_variant_and_they_agree():
    names = {v.name for v in kernel_harness.X86_VARIANTS + kernel_harness.ARM64_VARIANTS}
    assert set(KERNELS["variants"]) == names
    assert len(set(KERNELS["variants"].values())) == 1  # one set of bits for every CPU
    lines = [f"{name} {value}" for name, value in KERNELS["tensors"].items()]
    assert kernel_harness.digest(lines) == next(iter(KERNELS["variants"].values()))


HOST_VARIANTS = {"x86_64": kernel_harness.X86_VARIANTS, "aarch64": kernel_harness.ARM64_VARIANTS}.get(platform.machine(), ())


@pytest.fixture(scope="module")
def harness():
    if not sys.platform.startswith("linux") or not HOST_VARIANTS:
        pytest.skip(f"the harness builds on Linux x86-64 or arm64 (exact_gemm.c); this is {sys.platform} {platform.machine()}")
    if platform.machine() != "x86_64":
        return kernel_harness.build(platform.machine())
    gemm = build_kernel("exact_gemm")  # the very library the server loads (by path)
    assert gemm is not None and not isinstance(gemm, str), gemm
    return kernel_harness.build("x86_64", gemm)


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


@pytest.mark.parametrize("variant", HOST_VARIANTS or kernel_harness.X86_VARIANTS, ids=lambda v: v.name)
def test_kernel_variant_matches_golden(harness, variant):
    needs = {"x86-64 AVX-512": {"avx512f", "avx512bw", "avx512dq", "avx512vl"}, "x86-64 AVX2+FMA": {"avx2", "fma", "f16c"}}
    missing = needs.get(variant.name, set()) - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}: {variant.name} cannot run here")
    lines = kernel_harness.run(variant, harness)
    diff = kernel_harness.first_difference(KERNELS["tensors"], kernel_harness.tensors(lines))
    assert diff is None, f"{variant.name}: first differing tensor {diff}"
    assert kernel_harness.digest(lines) == KERNELS["variants"][variant.name]


def test_first_difference_names_the_tensor():
    reference = {"gemm-nt-1x1x1": "3 aa", "q4_1-1x1x32": "1 bb"}
    assert kernel_harness.first_difference(reference, dict(reference)) is None
    assert kernel_harness.first_difference(reference, {**reference, "q4_1-1x1x32": "1 cc"}).startswith("q4_1-1x1x32")
    assert kernel_harness.first_difference(reference, {"gemm-nt-1x1x1": "3 aa"}).startswith("q4_1-1x1x32")


@pytest.fixture(scope="module")
def q4_engine():
    """The server's own engine for the packaged model as q4_1, probed to 64 rows (where the q4 kernel
    does not load, as on macOS, the server's fallback: fp32, which the promise says gives the same bits)."""
    e = build_engine(make_config(weights="q4_1", max_tile=64))
    yield e
    e.close()


@pytest.mark.real_model
def test_packaged_model_matches_golden(q4_engine):
    golden = GOLDEN["model"]
    assert (golden["sink"], golden["window"]) == (golden_digests.SINK, golden_digests.WINDOW)
    got = golden_digests.model_table(q4_engine)
    served = f"(served {engine_weights(q4_engine)} on {platform.machine()})"
    for feed_name, want in golden["feeds"].items():
        have = got[feed_name]
        for chunking, digest in want["state_digest"].items():
            assert have["state_digest"][chunking] == digest, f"{feed_name} chunked {chunking}: state_digest differs {served}"
        assert have["greedy"] == want["greedy"], f"{feed_name}: greedy tokens differ {served}"
        assert have["seeded"] == want["seeded"], f"{feed_name}: seeded tokens differ {served}"
