#!/usr/bin/env python3
"""The native attention kernel's time per decode step, by context length and sessions.

One decode step's attention for SmolLM2-135M: 30 layers of `native_kernels.attend` (3 KV
heads x 3 query heads, head dim 64) for `rows` sessions of one row each, every session at the
same position over a sink 4 + window 1024 cache, all evaluated one layer at a time as the
forward does. Also records the machine's streaming-read bandwidth (scripts/benchkit). Absolute
times drift with the machine's load: compare within one run.

Usage: scripts/bench_attention.py [--reps 20] [--positions 100,500,2000] [--rows 1,8] [--out FILE]
Writes results/attention/<YYYY-MM-DD>-<host>.json. Run through the launcher's BLAS (it
re-executes itself with it), like the servers.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo (inference_engine)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (benchkit)

LAYERS, KV_HEADS, REP, HEAD_DIM = 30, 3, 3, 64


def step_ms(rows: int, position: int, reps: int) -> list[float]:
    """Milliseconds of one step's attention (30 layers) for `rows` sessions at `position`."""
    import mlx.core as mx
    import numpy as np

    from inference_engine.model import native_kernels
    from inference_engine.execution.kv_cache import CacheGeometry, SinkWindowKVCache

    kernels = native_kernels.active()
    assert kernels is not None
    g = CacheGeometry(sink=4, window=1024, max_block=64, max_rollback=8)
    rng = np.random.default_rng(0)
    caches = [SinkWindowKVCache(g, KV_HEADS, HEAD_DIM) for _ in range(rows)]
    for c in caches:
        c.keys = mx.array(rng.standard_normal(c.keys.shape).astype(np.float32))
        c.values = mx.array(rng.standard_normal(c.values.shape).astype(np.float32))
    q = mx.array(rng.standard_normal((rows, KV_HEADS, REP, HEAD_DIM)).astype(np.float32))
    kv = mx.array(rng.standard_normal((KV_HEADS, rows, HEAD_DIM)).astype(np.float32))
    mx.eval(q, kv, [c.state for c in caches])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _layer in range(LAYERS):
            for c in caches:
                c.offset = position
            mx.eval(native_kernels.attend(kernels, q, kv, kv, caches, [1] * rows))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> int:
    from inference_engine.blas import reexec_with_openblas

    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--positions", default="100,500,2000")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from benchkit.core import memory_bandwidth
    from inference_engine.quant_kernel import enable_native_kernels

    why_not = enable_native_kernels()
    if why_not:
        sys.exit(f"the native attention kernel is not available here: {why_not}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for position in (int(p) for p in args.positions.split(",")):
            ms = step_ms(rows, position, args.reps)
            keys = min(4, position + 1) + position + 1 - max(4, position - 1024)
            entry = {"rows": rows, "position": position, "keys": keys, "ms_median": statistics.median(ms),
                     "ms_min": min(ms), "ms_max": max(ms), "reps": args.reps}
            results.append(entry)
            print(f"rows {rows:2d} at position {position:5d} ({keys} keys): "
                  f"{entry['ms_median']:.2f} ms [{entry['ms_min']:.2f}-{entry['ms_max']:.2f}] per step", flush=True)
    report = {
        "meta": {"date": datetime.now().strftime("%Y-%m-%d"), "host": socket.gethostname().split(".")[0],
                 "machine": platform.machine(), "python": platform.python_version()},
        "bandwidth_gb_s": memory_bandwidth(1 << 30, reps=2)["gb_s"],
        "layers": LAYERS, "kv_heads": KV_HEADS, "query_heads_per_kv": REP, "head_dim": HEAD_DIM,
        "results": results,
    }
    root = Path(__file__).resolve().parents[1]
    out = args.out or root / "results" / "attention" / f"{report['meta']['date']}-{report['meta']['host']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
