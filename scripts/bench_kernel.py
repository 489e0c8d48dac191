#!/usr/bin/env python3
"""Matmul kernels head to head: the time of a step equivalent for block sizes M.

A "step equivalent" is the matmuls of one SmolLM2-135M forward on M rows, as MLX runs
them: 30 x [576->960 (q,k,v), 576->576 (o), 576->3072 (gate,up), 1536->576 (down)] + the
576->49152 LM head, each x @ W.T with its own weights (538 MB fp32, far more than the
caches), all evaluated as one MLX graph. Arms, each in its own process with its own
LD_PRELOAD, measured round-robin (load from elsewhere on the machine spreads over all):
- exact-gemm: native/exact_gemm.c in front of OpenBLAS (the launcher's default);
- row-gemv: native/row_gemv.c (one OpenBLAS sgemv per row up to 16 rows) in front of OpenBLAS;
- openblas: OpenBLAS 0.3.21's sgemm alone;
- blis: BLIS (Debian libblis4-pthread, BLIS_NUM_THREADS = cores), if installed;
- exact-q4: the q4_1 kernel (the MLX extension over exact-gemm's `exact_qgemm`) on the same
  step with the packaged GGUF's formats: Q4_1 linears, the Q8_0 576->49152 head (97 MB, not
  538), bitwise what exact-gemm computes on the dequantized weights.
Also records the machine's streaming-read bandwidth (scripts/benchkit). Absolute times
drift with the machine's load and bandwidth: compare ratios within one run.

Usage: scripts/bench_kernel.py [--reps 5] [--sizes 1,2,4,8,16,32,64] [--out FILE]
Writes results/kernel/<YYYY-MM-DD>-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo (inference_engine)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (benchkit)
from benchkit.report import cpu_name  # noqa: E402

LAYER = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of one block's matmuls
STEP = LAYER * 30 + [(576, 49152)]
BLIS = "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4"


def _blocks(rng, n: int, k: int, fmt: int):
    """n rows of k / 32 random GGUF blocks of type `fmt`, with sane fp16 scales."""
    import numpy as np

    from inference_engine.model.gguf_blocks import BLOCK_BYTES, Q4_1

    blocks = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[fmt]), dtype=np.uint8)
    blocks[..., 0:2] = (rng.standard_normal((n, k // 32, 1)) * 0.05).astype(np.float16).view(np.uint8)
    if fmt == Q4_1:
        blocks[..., 2:4] = (rng.standard_normal((n, k // 32, 1)) * 0.4).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def worker(q4: bool) -> None:
    """Arm process: build the weights, then answer each "M" on stdin with one step's ms."""
    import mlx.core as mx
    import numpy as np

    from inference_engine.blas import active_blas

    rng = np.random.default_rng(0)
    if q4:  # the packaged model's formats: Q4_1 linears, a Q8_0 head
        from inference_engine.model.gguf_blocks import Q4_1, Q8_0
        from inference_engine.quant_kernel import load_quant_kernel

        kernel = load_quant_kernel()
        if isinstance(kernel, str):
            sys.exit(f"exact-q4 arm: {kernel}")
        fmts = [Q8_0 if n == 49152 else Q4_1 for _, n in STEP]
        weights = [mx.array(_blocks(rng, n, k, f)) for (k, n), f in zip(STEP, fmts)]
        product = lambda x, w, f: kernel.qmatmul(x, w, f)  # noqa: E731
    else:
        fmts = [0] * len(STEP)
        weights = [mx.array(rng.standard_normal((n, k), dtype=np.float32)) for k, n in STEP]  # (out, in)
        product = lambda x, w, f: x @ w.T  # noqa: E731
    xs = {k: mx.array(rng.standard_normal((64, k), dtype=np.float32)) for k in {k for k, _ in STEP}}
    mx.eval(weights, list(xs.values()))
    print(json.dumps({"blas": active_blas(), "weight_bytes": sum(w.nbytes for w in weights)}), flush=True)
    for line in sys.stdin:
        m = int(line)
        rows = {k: x[:m] for k, x in xs.items()}
        mx.eval(list(rows.values()))
        start = time.perf_counter()
        mx.eval([product(rows[k], w, f) for (k, _), w, f in zip(STEP, weights, fmts)])  # (m, out) each
        print(json.dumps({"ms": (time.perf_counter() - start) * 1e3}), flush=True)


class Arm:
    """One arm's process."""

    def __init__(self, name: str, preload: list[str], env: dict[str, str]):
        self.name, self.preload = name, preload
        full_env = {**os.environ, **env, "LD_PRELOAD": ":".join(preload), "INFERENCE_ENGINE_BLAS_REEXEC": "1"}
        flag = ["--worker-q4"] if name == "exact-q4" else ["--worker"]
        self.proc = subprocess.Popen([sys.executable, __file__, *flag], env=full_env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        hello = json.loads(self.proc.stdout.readline())
        self.blas, self.weight_bytes = hello["blas"], hello["weight_bytes"]
        self.times: dict[int, list[float]] = {}

    def step_ms(self, m: int) -> float:
        self.proc.stdin.write(f"{m}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["ms"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def arms_available() -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (LD_PRELOAD, extra environment) of every arm this machine can run."""
    from inference_engine.blas import find_openblas, kernel_library

    openblas = find_openblas()
    if openblas is None:
        sys.exit("no OpenBLAS installed (apt-get install libopenblas0-pthread)")
    arms = {}
    for name, kernel in (("exact-gemm", "exact_gemm"), ("row-gemv", "row_gemv")):
        lib = kernel_library(kernel)
        if lib:
            arms[name] = ([lib, openblas], {})
        if name == "exact-gemm" and lib:
            arms["exact-q4"] = ([lib, openblas], {})
    arms["openblas"] = ([openblas], {})
    if Path(BLIS).is_file():
        arms["blis"] = ([BLIS], {"BLIS_NUM_THREADS": str(os.cpu_count() or 1)})
    return arms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed steps per (arm, M), after one warm-up")
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64", help="block sizes M")
    parser.add_argument("--arms", default="", help="comma-separated subset of the arms")
    parser.add_argument("--out", type=Path, help="JSON path (default results/kernel/<date>-<host>.json)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-q4", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or args.worker_q4:
        worker(q4=args.worker_q4)
        return 0
    from benchkit.core import memory_bandwidth

    import mlx.core as mx

    sizes = [int(s) for s in args.sizes.split(",")]
    chosen = arms_available()
    if args.arms:
        chosen = {k: v for k, v in chosen.items() if k in args.arms.split(",")}
    print("memory bandwidth ...", file=sys.stderr)
    bandwidth = memory_bandwidth(1 << 30, reps=3)
    arms = [Arm(name, preload, env) for name, (preload, env) in chosen.items()]
    try:
        for m in sizes:
            for arm in arms:
                arm.step_ms(m)  # warm-up: pool threads, page faults, MLX's graph cache
            for _ in range(args.reps):
                for arm in arms:
                    arm.times.setdefault(m, []).append(arm.step_ms(m))
            print(f"M={m:3d} " + "  ".join(f"{a.name} {statistics.median(a.times[m]):7.1f} ms" for a in arms),
                  file=sys.stderr)
    finally:
        for arm in arms:
            arm.close()
    weight_bytes = 4 * sum(k * n for k, n in STEP)
    medians = {a.name: {m: statistics.median(a.times[m]) for m in sizes} for a in arms}
    base = "row-gemv" if "row-gemv" in medians else next(iter(medians))
    report = {
        "date": datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
        "cpu": cpu_name(), "cores": os.cpu_count(), "mlx": mx.__version__, "python": platform.python_version(),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "reps": args.reps,
        "step": {"matmuls": len(STEP), "weight_bytes": weight_bytes, "shapes_in_out": "30 x " + str(LAYER) + " + [(576, 49152)]"},
        "bandwidth": bandwidth,
        "arms": {a.name: {"preload": a.preload, "blas": a.blas, "weight_bytes": a.weight_bytes,
                          "ms": {m: {"median": medians[a.name][m], "min": min(a.times[m]), "max": max(a.times[m]),
                                     "runs": a.times[m]} for m in sizes},
                          "gb_s_at_m1": a.weight_bytes / medians[a.name][1] / 1e6 if 1 in sizes else None}
                 for a in arms},
        "ratios": {"vs_" + base: {a: {m: medians[a][m] / medians[base][m] for m in sizes} for a in medians},
                   "vs_own_m1": {a: {m: medians[a][m] / medians[a][sizes[0]] for m in sizes} for a in medians}},
    }
    out = args.out or Path(__file__).resolve().parents[1] / "results" / "kernel" / f"{datetime.now():%Y-%m-%d}-{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    _print_table(report, sizes, base)
    print(f"wrote {out}")
    return 0


def _print_table(report: dict, sizes: list[int], base: str) -> None:
    arms = list(report["arms"])
    print(f"bandwidth {report['bandwidth']['gb_s']:.1f} GB/s streaming read; step = {report['step']['weight_bytes'] / 1e6:.0f} MB of weights")
    print("| M | " + " | ".join(f"{a} ms" for a in arms) + " | " + " | ".join(f"{a}/{base}" for a in arms if a != base) + " |")
    print("|---" * (1 + 2 * len(arms) - 1) + "|")
    for m in sizes:
        ms = [report["arms"][a]["ms"][m]["median"] for a in arms]
        ratios = [report["ratios"]["vs_" + base][a][m] for a in arms if a != base]
        print(f"| {m} | " + " | ".join(f"{v:.1f}" for v in ms) + " | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")


if __name__ == "__main__":
    sys.exit(main())
