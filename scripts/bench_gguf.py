#!/usr/bin/env python
"""Benchmark: Gemma-3-270M Q4_K_M (packaged:gemma3-270m) served from its own GGUF blocks vs fp32 dequantization.

Two real servers (`python -m inference_engine serve --model packaged:gemma3-270m`), one with
`--weights q4_1` (the file's Q4_K/Q5_0/Q6_K/Q8_0 blocks through the exact kernels) and one with
`--weights fp32` (gguf-py's fp32 dequantization of the same blocks: the same bits), started
together and measured round-robin (benchkit.core.run_interleaved), so load from elsewhere hits
both alike. Figures, each a median with min and max over the repetitions:
- decode tok/s (greedy after a short prompt, prefill excluded) and prefill tok/s (one
  AppendTokens of `prefill_tokens` into a fresh session);
- 8 sessions generating at once vs 1 (benchkit.concurrency.aggregate, aggregate tok/s);
- VmRSS idle and with 1 / 8 sessions (benchkit.engines.measure_rss);
- the limit: streaming-read bandwidth over the bytes one token reads (the GGUF's tensors, or fp32);
- whether both servers decoded the same tokens (they must: the same bits).
The llama.cpp arm (llama-cpp-python on the same file) is not here: it needs the bench extra's
llama-cpp-python, built separately.

Usage: scripts/bench_gguf.py [--quick] [--out FILE]; writes results/gguf/<YYYY-MM-DD>-<host>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo (inference_engine)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (benchkit)

from benchkit.concurrency import aggregate  # noqa: E402
from benchkit.core import (CHAT_PROMPT, CORPUS_MODULES, FULL, QUICK, ROOT, Prompts, memory_bandwidth,  # noqa: E402
                           run_interleaved, summary)
from benchkit.engines import measure_rss, start_server  # noqa: E402
from benchkit.report import cpu_name  # noqa: E402

MODEL = "packaged:gemma3-270m"


def gguf_prompts(path: Path, cache_dir: Path) -> Prompts:
    """The bench's chat prompt (as plain text: the base model has no chat turn) and corpus, in Gemma's tokens."""
    import importlib

    from inference_engine.model.gguf_model import gguf_tokenizer
    from inference_engine.model.gguf_reader import read_gguf

    tok = gguf_tokenizer(read_gguf(path), cache_dir)
    corpus = "\n\n".join(importlib.import_module(m).__doc__ or "" for m in CORPUS_MODULES)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return Prompts(encode(CHAT_PROMPT), encode(corpus), tok)


def weight_bytes(path: Path) -> dict[str, int]:
    """Bytes one decoded token reads: the GGUF's tensors as stored, or every parameter in fp32."""
    import numpy as np

    from inference_engine.model.gguf_reader import read_gguf

    tensors = read_gguf(path).tensors
    return {"fp32": 4 * sum(int(np.prod(t.shape)) for t in tensors), "gguf": sum(t.nbytes for t in tensors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long subset")
    parser.add_argument("--out", type=Path, help="JSON path (default results/gguf/<date>-<host>.json)")
    args = parser.parse_args()
    from inference_engine.blas import reexec_with_openblas

    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])  # as bench.py: the servers' BLAS here too
    from inference_engine.config import default_cache_dir
    from inference_engine.model.packaged import ensure_gemma_gguf

    plan = replace(QUICK if args.quick else FULL, window=256, sessions=8)
    cache = default_cache_dir()
    gguf = ensure_gemma_gguf(cache)
    prompts = gguf_prompts(gguf, cache)
    t0 = time.time()
    with ExitStack() as stack:
        blocks, c_blocks = start_server(plan, prompts, stack, "q4_1", model=MODEL)
        fp32, c_fp32 = start_server(plan, prompts, stack, "fp32", model=MODEL)
        results = run_interleaved({"blocks": c_blocks, "fp32": c_fp32}, plan)
        many = {name: {"1": aggregate(s, prompts, 1, plan.new_tokens), "8": aggregate(s, prompts, 8, plan.new_tokens)}
                for name, s in (("blocks", blocks), ("fp32", fp32))}
        rss = {"blocks": measure_rss(blocks, plan, prompts), "fp32": measure_rss(fp32, plan, prompts)}
    bandwidth = memory_bandwidth(plan.bandwidth_bytes, 3 if args.quick else 5)
    weights = weight_bytes(gguf)
    engines = {}
    for name, r in results.items():
        decode = [(len(t.tokens) - 1) / (t.times[-1] - t.times[0]) for t in r.decode if len(t.times) > 1]
        engines[name] = {
            "extra": r.extra, "decode_tok_s": summary(decode),
            "prefill_tok_s": summary([plan.prefill_tokens / s for s in r.prefill_s]),
            "limit_tok_s": bandwidth["gb_s"] * 1e9 / weights["gguf" if name == "blocks" else "fp32"],
            "sessions_1_tok_s": many[name]["1"]["tok_s"], "sessions_8_tok_s": many[name]["8"]["tok_s"],
            "sessions_8_over_1": many[name]["8"]["tok_s"] / many[name]["1"]["tok_s"],
        }
    med = {k: e["decode_tok_s"]["median"] for k, e in engines.items()}
    report = {
        "meta": {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "quick": args.quick,
                 "plan": asdict(plan), "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                 "model": MODEL, "gguf": str(gguf), "seconds": time.time() - t0,
                 "load_average_at_end": os.getloadavg()},
        "bandwidth": bandwidth,
        "weight_bytes": weights,
        "engines": engines,
        "rss": rss,
        "ratios": {
            "decode_blocks_over_fp32": med["blocks"] / med["fp32"],
            "prefill_blocks_over_fp32": engines["blocks"]["prefill_tok_s"]["median"] / engines["fp32"]["prefill_tok_s"]["median"],
            "idle_rss_blocks_over_fp32": rss["blocks"]["idle_mib"] / rss["fp32"]["idle_mib"],
        },
        "same_tokens": results["blocks"].decode[0].tokens == results["fp32"].decode[0].tokens
        and many["blocks"]["8"]["first_stream"] == many["fp32"]["8"]["first_stream"],
    }
    out = args.out or ROOT / "results" / "gguf" / f"{report['meta']['date']}-{report['meta']['host']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    for name, e in engines.items():
        print(f"{name:7s} decode {e['decode_tok_s']['median']:6.1f} tok/s  prefill {e['prefill_tok_s']['median']:6.1f} tok/s  "
              f"8 vs 1 sessions {e['sessions_8_over_1']:.2f}x  idle RSS {rss[name]['idle_mib']:.0f} MiB")
    print(json.dumps(report["ratios"]), "same tokens:", report["same_tokens"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
