#!/usr/bin/env python
"""Profile: the products of one Gemma-3-270M Q4_K_M step, per kind, as served from the GGUF's blocks.

A decode step of `packaged:gemma3-270m` served from its blocks is, in bytes, its products: per
layer the fused q/k/v (Q8_0 where attn_v is Q8_0: the Q5_0 q/k become Q8_0 blocks of the same
weights, as fused_block.concat_linears does; Q5_0 otherwise), attn_output (Q4_K), the fused
gate/up (Q5_0) and ffn_down (Q6_K or Q4_K), then the tied LM head (262,144 x 640 Q8_0, 178 MB:
three quarters of the bytes a token reads). This runs exactly those products through the exact
kernel (quant_kernel.load_quant_kernel, its thread pool as served), layer by layer as the native
block does, so the weights stream from memory as in a real step (250 MB, far beyond the caches),
and reports per kind: ms per step (summed over the layers), the bytes it read and GB/s, for
`--rows` rows (1: decode; 64: a prefill block). The step's other work (attention, norms, the
graph) is what a served step takes beyond this sum.

`cpu_ms` is the process's CPU time: with EXACT_GEMM_NUM_THREADS=1 the kernel's own cost, which
a busy machine disturbs far less than the wall time (its pool's workers spin for the next call,
so with more threads it includes their waiting).

Repetitions alternate with nothing else: run two builds back to back (this script from two
checkouts) for an A/B under the same load; the load average is recorded at start and end.

Usage: scripts/profile_gguf_products.py [--rows 1,64] [--reps 5] [--out FILE]
Writes results/gguf/<YYYY-MM-DD>-<host>-products.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo (inference_engine)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from inference_engine.model.gguf_blocks import FORMAT_NAMES, Q8_0, as_q8_0  # noqa: E402
from inference_engine.model.gguf_reader import read_gguf  # noqa: E402
from inference_engine.model.packaged import ensure_gemma_gguf  # noqa: E402
from inference_engine.quant_kernel import load_quant_kernel  # noqa: E402


def step_products(path: Path) -> list[tuple[str, int, mx.array]]:
    """(kind, ggml type, blocks (N, bytes)) of one step, in the order a step runs them."""
    g = read_gguf(path)
    t = {x.name: x for x in g.tensors}

    def blocks(name: str) -> tuple[int, np.ndarray]:
        info = t[name]
        return info.kind, g.tensor_bytes(info).reshape(int(np.prod(info.shape[:-1])), -1)

    out: list[tuple[str, int, mx.array]] = []
    layers = int(g.get("gemma3.block_count"))
    for i in range(layers):
        qkv = [blocks(f"blk.{i}.attn_{p}.weight") for p in "qkv"]
        if len({k for k, _ in qkv}) > 1:  # the Q8_0 form of the Q5_0 parts (gguf_blocks.fuse_formats)
            qkv = [(Q8_0, b if k == Q8_0 else as_q8_0(b, k)) for k, b in qkv]
        gate_up = [blocks(f"blk.{i}.ffn_{p}.weight") for p in ("gate", "up")]
        for kind, parts in (("qkv", qkv), ("attn_output", [blocks(f"blk.{i}.attn_output.weight")]),
                            ("gate_up", gate_up), ("ffn_down", [blocks(f"blk.{i}.ffn_down.weight")])):
            out.append((kind, parts[0][0], mx.array(np.concatenate([b for _, b in parts]))))
    kind, head = blocks("token_embd.weight")
    out.append(("lm_head", kind, mx.array(head)))
    mx.eval([b for _, _, b in out])
    return out


def profile(products: list[tuple[str, int, mx.array]], rows: int, reps: int) -> dict[str, dict[str, float]]:
    """Per kind: median ms per step over `reps` steps, bytes per step, GB/s."""
    kernel = load_quant_kernel()
    assert not isinstance(kernel, str), kernel
    rng = np.random.default_rng(0)
    xs = {k: mx.array(rng.standard_normal((rows, k)).astype(np.float32)) for k in (640, 1024, 2048)}
    mx.eval(list(xs.values()))
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for _ in range(reps + 1):  # the first step warms the pool and the pages
        step: dict[str, float] = {}
        step_cpu: dict[str, float] = {}
        for kind, fmt, blocks in products:
            k_in = {"attn_output": 1024, "ffn_down": 2048}.get(kind, 640)
            t0, c0 = time.perf_counter(), time.process_time()
            mx.eval(kernel.qmatmul(xs[k_in], blocks, fmt))
            step[kind] = step.get(kind, 0.0) + time.perf_counter() - t0
            step_cpu[kind] = step_cpu.get(kind, 0.0) + time.process_time() - c0
        for kind, s in step.items():
            times.setdefault(kind, []).append(s)
            cpu.setdefault(kind, []).append(step_cpu[kind])
    out = {}
    for kind, ts in times.items():
        ms = statistics.median(ts[1:]) * 1e3
        nbytes = sum(b.nbytes for k, _, b in products if k == kind)
        fmts = sorted({FORMAT_NAMES[f] for k, f, _ in products if k == kind})
        out[kind] = {"ms": round(ms, 3), "min_ms": round(min(ts[1:]) * 1e3, 3),
                     "cpu_ms": round(statistics.median(cpu[kind][1:]) * 1e3, 3), "mb": round(nbytes / 1e6, 1),
                     "gb_s": round(nbytes / ms / 1e6, 2), "formats": fmts}
    out["total"] = {"ms": round(sum(v["ms"] for v in out.values()), 3),
                    "cpu_ms": round(sum(v["cpu_ms"] for v in out.values()), 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,64", help="rows per product, comma-separated (1: decode)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from inference_engine.config import default_cache_dir

    path = ensure_gemma_gguf(default_cache_dir())
    products = step_products(path)
    load_start = os.getloadavg()
    result = {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "cpus": os.cpu_count(),
              "gguf": str(path), "load_avg_start": load_start,
              "kernel": load_quant_kernel().version,  # type: ignore[union-attr]
              "rows": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        result["rows"][str(rows)] = profile(products, rows, args.reps)
        print(rows, json.dumps(result["rows"][str(rows)]), flush=True)
    result["load_avg_end"] = os.getloadavg()
    out = args.out or Path(__file__).resolve().parents[1] / "results" / "gguf" / (
        f"{result['date']}-{result['host']}-products.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
