#!/usr/bin/env python
"""Benchmark: where a routed decode step's time goes, worker compute against the front server's relay.

One session decodes greedily on a 3-worker route (PIPELINE_RANGES of the packaged SmolLM2-135M,
workers of this tree on loopback, plaintext) and, round-robin with it, in one process. Every
route step goes front → head → front → middle → front → tail → front: the front server relays
each hop's hidden state. Per decode step (medians over `--reps`):

- `step_ms`: the route's step period (1 / decode tok/s);
- `compute_ms`: the workers' own forward time (each worker's Health `busy_seconds` over its steps);
- `hop_overhead_ms`: the hops' round trips minus that compute: framing, tensor codec and CRC32C
  at both ends, gRPC and HTTP/2 on loopback, the worker's admission and its engine-thread hand-over;
- `front_loop_ms`: the step period minus the hops (sampling, the scheduler, the stream's hand-over);
- `empty_round_ms`: a round of three hops carrying no tensor and no compute (a 0-token ShardTrim):
  the protocol's fixed cost of three hops, measured on its own;
- `codec_ms`: what the front server itself spends per step encoding and decoding tensors (CRC32C
  included): 2 hidden states out, 2 hidden states and 1 logits row in, timed in this process.

Worker-to-worker forwarding would drop 2 of a step's 6 messages (the head's and the middle's
answers to the front, and the front's re-sends) and the front's codec work; the worker's side of
each hop (admission, the engine-thread hand-over, its own codec) stays. `forwarding_saves_at_most_ms`
bounds the gain generously: 2/3 of `empty_round_ms` (the whole fixed cost of two of the three hops,
though forwarded frames still cross a worker-to-worker hop) plus `codec_ms`.
`work_frame_extra_ms` = `hop_overhead_ms` - `empty_round_ms`: what a work frame costs its hops beyond
the fixed round (tensor bytes, the worker's batch queue), which forwarding would not remove either.

Usage: scripts/bench_route_relay.py [--reps N] [--tokens N] [--out FILE]
(default out: results/pipeline/<date>-<host>-route-relay.json).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo (inference_engine)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (benchkit)

from benchkit.core import ROOT, summary  # noqa: E402
from benchkit.engines import (PIPELINE_RANGES, route_bench_parser, runtime_decode, start_route_bench,  # noqa: E402
                              start_route_workers, tear_down)

from inference_engine.blas import reexec_with_openblas  # noqa: E402
from inference_engine.readiness import wait_ready  # noqa: E402


def worker_counters(addresses: list[str]) -> list[tuple[int, float]]:
    """(steps, busy seconds) of each worker's engine, from its Health answer."""
    import grpc

    from inference_engine.v1 import shard_runtime_pb2 as pb
    from inference_engine.v1 import shard_runtime_pb2_grpc as pb_grpc

    out = []
    for a in addresses:
        with grpc.insecure_channel(a) as channel:
            r = pb_grpc.ShardRuntimeStub(channel).Health(pb.ShardHealthRequest(), timeout=30)
            out.append((r.steps, r.busy_seconds))
    return out


def codec_ms(hidden: int, vocab: int, reps: int = 200) -> dict[str, float]:
    """Per step, the front server's own tensor work: 2 hidden encodes, 2 hidden + 1 logits decodes (CRC32C in each)."""
    import numpy as np

    from inference_engine.shard.protocol.tensor_codec import decode_tensor, encode_tensor

    h = np.random.default_rng(0).standard_normal((1, hidden)).astype(np.float32)
    logits = np.random.default_rng(1).standard_normal((1, vocab)).astype(np.float32)
    eh, el = encode_tensor(h), encode_tensor(logits)

    def per_call_ms(fn: Any) -> float:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e3 * (time.perf_counter() - t) / reps

    enc_h, dec_h = per_call_ms(lambda: encode_tensor(h)), per_call_ms(lambda: decode_tensor(eh))
    dec_l = per_call_ms(lambda: decode_tensor(el))
    return {"encode_hidden_ms": enc_h, "decode_hidden_ms": dec_h, "decode_logits_ms": dec_l,
            "front_per_step_ms": 2 * enc_h + 2 * dec_h + dec_l}


async def empty_rounds(pipeline: Any, tokens: list[int], n: int) -> list[float]:
    """Wall ms of `n` rounds of a 0-token ShardTrim through the three hops (no tensor, no compute)."""
    sid = "relay-probe"
    await pipeline.open(sid, sink=4, window=1024)
    await pipeline.forward(sid, tokens, all_logits=False)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await pipeline.trim(sid, 0)
        out.append(1e3 * (time.perf_counter() - t))
    await pipeline.release(sid)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    reexec_with_openblas([str(Path(__file__).resolve()), *argv])
    parser = route_bench_parser(__doc__, reps=3, tokens=64)
    parser.add_argument("--empty-rounds", type=int, default=50)
    args = parser.parse_args(argv)

    from inference_engine.runtime.runtime import Runtime
    from inference_engine.server.server import connect_shards

    bench = start_route_bench(("single_process", "route"), max_sessions=2)
    prompts, cfg, engines, block = bench.prompts, bench.cfg, bench.engines, bench.block
    workers = start_route_workers(block, 4)
    loop = asyncio.new_event_loop()
    rows: list[dict[str, float]] = []
    single: list[float] = []
    same_tokens = True
    try:
        addresses = [wait_ready(w) for w in workers]
        route, _ = loop.run_until_complete(connect_shards(replace(cfg, shards=tuple(addresses)), engines["route"]))
        runtimes = {name: Runtime(e, cfg) for name, e in engines.items()}
        for runtime in runtimes.values():  # warm-up
            loop.run_until_complete(runtime_decode(runtime, prompts, 8))
        for rep in range(args.reps):
            single_trace = loop.run_until_complete(runtime_decode(runtimes["single_process"], prompts, args.tokens))
            trace = loop.run_until_complete(runtime_decode(
                runtimes["route"], prompts, args.tokens, lambda: (route.pipeline.hop_stats(), worker_counters(addresses))))
            (hops0, work0), (hops1, work1) = trace.counters
            same_tokens = same_tokens and trace.tokens == single_trace.tokens
            hop_ms = [1e3 * (a.seconds - b.seconds) / max(1, a.calls - b.calls) for a, b in zip(hops1, hops0)]
            compute = [1e3 * (b[1] - a[1]) / max(1, b[0] - a[0]) for a, b in zip(work0, work1)]
            step = 1e3 / trace.decode_tok_s
            rows.append({"step_ms": step, "hops_ms": sum(hop_ms), "compute_ms": sum(compute),
                         "hop_overhead_ms": sum(hop_ms) - sum(compute), "front_loop_ms": step - sum(hop_ms),
                         "decode_tok_s": trace.decode_tok_s})
            single.append(single_trace.decode_tok_s)
            print(f"rep {rep + 1}/{args.reps}: route {trace.decode_tok_s:.1f} tok/s, single "
                  f"{single_trace.decode_tok_s:.1f} tok/s; step {step:.1f} ms = compute {sum(compute):.1f} + hop "
                  f"overhead {sum(hop_ms) - sum(compute):.1f} + front loop {step - sum(hop_ms):.1f}",
                  file=sys.stderr, flush=True)
        empty = route.call(lambda: empty_rounds(route.pipeline, list(prompts.chat[:16]), args.empty_rounds))
        args_ = engines["single_process"].loaded.model.args
        codec = codec_ms(int(args_.hidden_size), int(args_.vocab_size))
        loop.run_until_complete(route.stop())
    finally:
        tear_down(loop, engines, workers)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out: dict[str, Any] = {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "host": socket.gethostname(), "cpus": os.cpu_count(), "load_at_start": bench.load_at_start,
                 "load_at_end": os.getloadavg(), "ranges": list(PIPELINE_RANGES), "block": block,
                 "tokens": args.tokens, "reps": args.reps},
        "per_rep": rows,
        "median": med,
        "single_process_decode_tok_s": summary(single),
        "route_over_single": med["decode_tok_s"] / statistics.median(single),
        "empty_round_ms": summary(empty),
        "codec": codec,
        "shares_of_step": {k: med[k] / med["step_ms"] for k in ("compute_ms", "hop_overhead_ms", "front_loop_ms")},
        "work_frame_extra_ms": med["hop_overhead_ms"] - statistics.median(empty),
        "forwarding_saves_at_most_ms": 2 / 3 * statistics.median(empty) + codec["front_per_step_ms"],
        "tokens_identical": same_tokens,
    }
    out["forwarding_saves_at_most_share"] = out["forwarding_saves_at_most_ms"] / med["step_ms"]
    path = args.out or ROOT / "results" / "pipeline" / f"{datetime.date.today()}-{socket.gethostname()}-route-relay.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "per_rep"}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
