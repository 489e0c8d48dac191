#!/usr/bin/env python3
"""Cost of the bit-exact path: prefill and decode tokens/s, exact vs plain, same run, same model.

- exact: blocks of the probed tile (row-invariant matmul bits), canonical key layout.
- plain: the same engine with 512-row blocks (what a naive verifier does; not chunking-invariant).
- mlx_lm: mlx-lm's own forward with its standard KV cache (reference point, not our code).
Decode is greedy, one token per step. Writes JSON to results/exact-cost/<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inference_engine.blas import active_blas, reexec_with_openblas  # noqa: E402


def _median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from inference_engine.config import default_cache_dir
    from inference_engine.model.loader import load_model
    from inference_engine.model.packaged import ensure_packaged_model
    from inference_engine.runtime.engine import Engine

    loaded = load_model(ensure_packaged_model(default_cache_dir()))
    engines = {
        "exact": Engine(loaded, exact=True, max_tile=16, plain_block=args.prompt, max_rollback=8),
        "plain": Engine(loaded, exact=False, max_tile=16, plain_block=args.prompt, max_rollback=8),
    }
    prompt = np.random.default_rng(0).integers(0, loaded.spec.vocab_size, args.prompt).tolist()
    window = 1024

    def ours(engine: Engine) -> tuple[float, float]:
        v = engine.make_verifier(4, window)
        t = time.perf_counter()
        v.prefill(prompt)
        prefill = args.prompt / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(args.decode):
            token = int(mx.argmax(v.next_token_logits).item())
            v.forward_block([token], all_logits=False)
            v.commit_or_truncate(1, 1)
        return prefill, args.decode / (time.perf_counter() - t)

    def mlx_lm_native() -> tuple[float, float]:
        model = loaded.model
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        logits = model(mx.array(prompt)[None], cache=cache)
        mx.eval(logits)
        prefill = args.prompt / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(args.decode):
            token = mx.argmax(logits[0, -1])
            logits = model(token.reshape(1, 1), cache=cache)
            mx.eval(logits)
        return prefill, args.decode / (time.perf_counter() - t)

    runs: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in ("exact", "plain", "mlx_lm")}
    for _ in range(args.reps):
        for name, fn in (("exact", lambda: ours(engines["exact"])), ("plain", lambda: ours(engines["plain"])), ("mlx_lm", mlx_lm_native)):
            p, d = fn()
            runs[name]["prefill"].append(p)
            runs[name]["decode"].append(d)
    figures = {k: {m: _median_range(v) for m, v in r.items()} for k, r in runs.items()}
    cost = {
        m: 1 - figures["exact"][m]["median"] / figures["plain"][m]["median"] for m in ("prefill", "decode")
    }
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "blas": active_blas(),
        "model": loaded.spec.name,
        "exact_tile": engines["exact"].block,
        "prompt_tokens": args.prompt,
        "decode_tokens": args.decode,
        "reps": args.reps,
        "tokens_per_s": figures,
        "exact_cost_vs_plain": cost,
        "exact_vs_mlx_lm": {m: figures["exact"][m]["median"] / figures["mlx_lm"][m]["median"] for m in ("prefill", "decode")},
    }
    out = args.out or Path("results/exact-cost") / f"{datetime.now():%Y-%m-%d}-{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"BLAS {report['blas']}, exact tile {report['exact_tile']}")
    print(f"{'path':8} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for k in runs:
        print(f"{k:8} {figures[k]['prefill']['median']:14.1f} {figures[k]['decode']['median']:13.2f}")
    print(f"exact cost vs plain: prefill {cost['prefill']:+.1%}, decode {cost['decode']:+.1%}  -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
