"""Write tests/golden/digests.json (tests/golden_digests.py says what it holds).

Refuses to replace an existing table unless --overwrite is given: a golden value changes only
in a commit that says why. Every kernel variant must run (the arm64 ones need
scripts/check_arm64.sh's packages) and agree, or nothing is written. It lives in tests/ because it
is built from the tests' own harness (golden_digests.py, kernel_harness.py):
    .venv/bin/python tests/write_golden_digests.py [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference_engine.blas import build_kernel  # noqa: E402
from inference_engine.config import default_cache_dir  # noqa: E402
from inference_engine.quant_kernel import enable_native_kernels  # noqa: E402
from inference_engine.server.server import build_engine, engine_weights  # noqa: E402
from tests import golden_digests, kernel_harness  # noqa: E402
from tests.conftest import make_config  # noqa: E402


def kernel_table() -> dict:
    """Every variant's digest and the tensors they share; exits if one cannot run or differs."""
    gemm = build_kernel("exact_gemm")
    variants, reference = {}, None
    for variant in kernel_harness.X86_VARIANTS + kernel_harness.ARM64_VARIANTS:
        binary = kernel_harness.build(variant.arch, gemm if variant.arch == "x86_64" else None)
        lines = kernel_harness.run(variant, binary)
        tensors = kernel_harness.tensors(lines)
        reference = reference or tensors
        diff = kernel_harness.first_difference(reference, tensors)
        if diff:
            sys.exit(f"{variant.name} differs from the first variant at {diff}: nothing written")
        variants[variant.name] = kernel_harness.digest(lines)
        print(f"{variant.name}: {variants[variant.name][:16]}", file=sys.stderr)
    return {"variants": variants, "tensors": reference}


def main() -> int:
    parser = argparse.ArgumentParser(description="write tests/golden/digests.json")
    parser.add_argument("--overwrite", action="store_true", help="replace the committed table (say why in the commit)")
    args = parser.parse_args()
    if golden_digests.GOLDEN.exists() and not args.overwrite:
        print(f"{golden_digests.GOLDEN} exists; pass --overwrite to replace it (and say why in the commit)", file=sys.stderr)
        return 1
    kernels = kernel_table()
    problem = enable_native_kernels(default_cache_dir())  # as servers bind them at start
    print(f"native kernels: {problem or 'bound'}", file=sys.stderr)
    engine = build_engine(make_config(weights="q4_1", max_tile=64))
    try:
        if engine_weights(engine) != "q4_1":
            sys.exit(f"the packaged model serves {engine_weights(engine)}, not q4_1: nothing written")
        model = golden_digests.model_table(engine)
    finally:
        engine.close()
    table = {"about": "tests/golden_digests.py; written by tests/write_golden_digests.py, never silently",
             "model": {"name": "smollm2-135m", "weights": "q4_1", "sink": golden_digests.SINK,
                       "window": golden_digests.WINDOW, "feeds": model},
             "kernels": kernels}
    golden_digests.GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    golden_digests.GOLDEN.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {golden_digests.GOLDEN}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
