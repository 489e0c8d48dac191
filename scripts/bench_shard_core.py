#!/usr/bin/env python
"""Benchmark: shard workers on their own engine (before) against workers on the runtime's core (after).

One run, one machine: two 3-worker routes (PIPELINE_RANGES of the packaged SmolLM2-135M), one
whose workers run an older tree of this repository (`--before`, e.g. a detached worktree of
main at 829f8c7: EngineThread + StepBatcher with its 5 ms gathering timer) and one whose
workers run this tree (the runtime's Scheduler thread, BatchQueue, LocalBackend over the
span), and the same Runtime in one process. The front server side is this tree's for all
three, in this process over one event loop; repetitions run round-robin, so load from
elsewhere hits them alike. Figures (median, min, max over `--reps`):

- decode tok/s of one session (greedy, `--tokens` tokens after the chat prompt, from the
  first generated token to the last), per engine, and each route over the single process;
- tok/s of 8 sessions generating at once (all tokens over the time to the last one);
- per-hop ms of the routes (from sending a hop its frame to its checked answer; hops run one
  after another, so a step costs the sum of its hops plus the front server's relay);
- relay ms per step (one session): the decode step period minus the sum of its hops' latency,
  i.e. what relaying every hop's hidden states through the front server (and its own loop) adds;
- whether every route's tokens equal the single process's.

Usage: scripts/bench_shard_core.py --before DIR [--reps N] [--tokens N] [--out FILE]
(default out: results/pipeline/<date>-<host>-shard-core.json).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo (inference_engine)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (benchkit)

from benchkit.core import ROOT, summary  # noqa: E402
from benchkit.engines import (PIPELINE_RANGES, route_bench_parser, runtime_decode,  # noqa: E402
                              runtime_sessions_at_once, start_route_bench, start_route_workers, tear_down)

from inference_engine.blas import reexec_with_openblas  # noqa: E402
from inference_engine.readiness import wait_ready  # noqa: E402


def relay_ms(trace: Any, then: list, now: list) -> float:
    """What one decode step costs beyond its hops: the step period minus the sum of the hops' mean latency.

    A step's hops run one after another (head, middle, tail), each timed from sending its
    frame to its checked answer; the rest of the period is the front server relaying hidden
    states between them and running its own loop (sampling, the stream's hand-over).
    """
    hop_ms = sum(1e3 * (a.seconds - b.seconds) / max(1, a.calls - b.calls) for a, b in zip(now, then))
    return 1e3 / trace.decode_tok_s - hop_ms


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    reexec_with_openblas([str(Path(__file__).resolve()), *argv])
    parser = route_bench_parser(__doc__, reps=5, tokens=128)
    parser.add_argument("--before", type=Path, required=True, help="a tree whose workers are the 'before' route")
    parser.add_argument("--sessions", type=int, default=8)
    args = parser.parse_args(argv)

    from inference_engine.runtime.runtime import Runtime
    from inference_engine.server.server import connect_shards

    names = ("single_process", "route_before", "route_after")
    bench = start_route_bench(names, max_sessions=args.sessions)
    prompts, cfg, engines, block = bench.prompts, bench.cfg, bench.engines, bench.block
    trees = {"route_before": args.before.resolve(), "route_after": ROOT}
    workers = {name: start_route_workers(block, 2 * args.sessions, tree) for name, tree in trees.items()}
    loop = asyncio.new_event_loop()
    routes = {}
    try:
        for name, ws in workers.items():
            addresses = [wait_ready(w) for w in ws]
            routes[name], _ = loop.run_until_complete(
                connect_shards(replace(cfg, shards=tuple(addresses)), engines[name]))
        runtimes = {name: Runtime(e, cfg) for name, e in engines.items()}
        for runtime in runtimes.values():  # warm-up
            loop.run_until_complete(runtime_decode(runtime, prompts, 8))
        before = {name: route.pipeline.hop_stats() for name, route in routes.items()}
        traces: dict[str, list] = {name: [] for name in names}
        many: dict[str, list] = {name: [] for name in names}
        relay: dict[str, list[float]] = {name: [] for name in routes}  # per decode rep: step ms minus the hops' ms
        for rep in range(args.reps):
            for name, runtime in runtimes.items():
                route = routes.get(name)
                trace = loop.run_until_complete(runtime_decode(runtime, prompts, args.tokens,
                                                               route.pipeline.hop_stats if route else None))
                traces[name].append(trace)
                if trace.counters:
                    relay[name].append(relay_ms(trace, *trace.counters))
            for name, runtime in runtimes.items():
                many[name].append(loop.run_until_complete(
                    runtime_sessions_at_once(runtime, prompts, args.sessions, args.tokens)))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
                f"{n} {traces[n][-1].decode_tok_s:.1f} / {many[n][-1]['tok_s']:.1f} tok/s" for n in names),
                file=sys.stderr, flush=True)
        hops = {name: [{"layers": str(a.layers), "calls": a.calls - b.calls,
                        "mean_ms": 1e3 * (a.seconds - b.seconds) / max(1, a.calls - b.calls)}
                       for a, b in zip(route.pipeline.hop_stats(), before[name])]
                for name, route in routes.items()}
        loop.run_until_complete(asyncio.sleep(0.2))  # closed sessions' releases reach the workers
        for route in routes.values():
            loop.run_until_complete(route.stop())
    finally:
        tear_down(loop, engines, [w for ws in workers.values() for w in ws])
    for name in routes:
        out_relay = summary(relay[name])
        relay[name] = out_relay  # type: ignore[assignment]
    out: dict[str, Any] = {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "host": socket.gethostname(), "cpus": os.cpu_count(), "load_at_start": bench.load_at_start,
                 "load_at_end": os.getloadavg(), "before_tree": str(args.before), "ranges": list(PIPELINE_RANGES),
                 "block": block, "tokens": args.tokens, "reps": args.reps, "sessions": args.sessions},
        "hops": hops,
    }
    for name in names:
        out[name] = {"decode_tok_s": summary([t.decode_tok_s for t in traces[name]]),
                     "sessions_tok_s": summary([m["tok_s"] for m in many[name]])}
    single = out["single_process"]
    for name in ("route_before", "route_after"):
        out[name]["decode_over_single"] = out[name]["decode_tok_s"]["median"] / single["decode_tok_s"]["median"]
        out[name]["sessions_over_single"] = out[name]["sessions_tok_s"]["median"] / single["sessions_tok_s"]["median"]
        out[name]["sessions_over_one"] = out[name]["sessions_tok_s"]["median"] / out[name]["decode_tok_s"]["median"]
        out[name]["relay_ms_per_step"] = relay[name]
        out[name]["tokens_identical"] = (all(a.tokens == b.tokens for a, b in zip(traces[name], traces["single_process"]))
                                         and all(a["first_stream"] == b["first_stream"]
                                                 for a, b in zip(many[name], many["single_process"])))
    out["after_over_before"] = {
        "decode": out["route_after"]["decode_tok_s"]["median"] / out["route_before"]["decode_tok_s"]["median"],
        "sessions": out["route_after"]["sessions_tok_s"]["median"] / out["route_before"]["sessions_tok_s"]["median"],
    }
    path = args.out or ROOT / "results" / "pipeline" / f"{datetime.date.today()}-{socket.gethostname()}-shard-core.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("route_before", "route_after", "single_process", "after_over_before", "hops")},
                     indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
