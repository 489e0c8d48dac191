#!/usr/bin/env python
"""Benchmark: our runtime against mlx-lm and llama.cpp, and against the memory-bandwidth limit.

One run, one machine, one model (the packaged SmolLM2-135M), one BLAS for MLX's own matmuls
(OpenBLAS preloaded by re-exec, for mlx-lm; our engines' exact products run on the exact
kernels either way). All engines are loaded at once and
their repetitions run round-robin, so load from elsewhere hits them alike. Figures, each
a median over several repetitions with min and max:

- decode tok/s: greedy, `new_tokens` tokens after a short chat prompt, counted from the
  first generated token to the last ((N - 1) tokens over that time), so prefill is
  excluded. Engines: `server` (a real `python -m inference_engine serve` subprocess over
  gRPC with its default `--weights q4_1`, Generate with ignore_eos), `server_fp32` (the
  same with `--weights fp32`: the same bits from 5.5x the bytes), `in_process` (the
  server's Runtime driven directly, no gRPC), `mlx_lm` (`stream_generate` on the same fp32
  folder, EOS disabled) and `llama_cpp` (llama-cpp-python on the Q4_1 GGUF the fp32 folder
  was converted from).
- prefill tok/s: a `prefill_tokens`-token prompt into an empty context, until the
  next-token logits exist (server: one AppendTokens RPC on a fresh session).
- TTFT ms: from sending the short prompt to receiving the first generated token.
- per-token ms and gRPC overhead: 1000 / decode tok/s; server minus in-process is what
  the gRPC stream costs per token.
- AppendTokens ms: 16 tokens appended at a short history and at a long one that has
  wrapped the sink-window; the cached key set has a fixed size, so these should match.
- server RSS MiB: VmRSS of the server process idle, with 1 and with 8 open sessions
  (`server_rss`), and of the fp32 server (`server_rss_fp32`).
- session snapshots (benchkit/snapshots.py): snapshot and restore time and bytes at the plan's
  window against replaying the history; restart-to-serving with 8 persisted sessions.
- the limit: streaming-read bandwidth (numpy sum over a buffer far larger than the
  caches, best of several, 1 and all threads) divided by the weight bytes one decoded
  token must read (every parameter once; the tied embedding is read whole by the LM
  head). Each decode figure is shown as a fraction of the limit of the weights it reads
  (the GGUF's Q4_1/Q8_0 tensors for llama.cpp and q4_1 engines, fp32 for the others).
- q4_1 targets (`q4_1`): single-session decode over llama.cpp's, the 8-session aggregate
  over llama.cpp's single stream (`aggregate_vs_llama_cpp`: the two measured back to back,
  `reps` times, median of the ratios), prefill over the fp32 server's, idle RSS over the
  fp32 server's, and whether the q4_1 and fp32 servers decoded the same tokens.
- checks (benchkit/checks.py): the speed and ratio bounds a sane run meets (bandwidth, fraction
  of the limit, snapshot restore over replay), each with its value and whether it held; the
  failed ones are printed. The tests read the figures' shape, never their speed.

Usage: scripts/bench.py [--quick] [--out FILE]. The full run writes
results/bench/<YYYY-MM-DD>-<host>.json; --quick is a seconds-long subset for CI.
--snapshots-only measures the snapshot section alone (results/snapshots/<date>-<host>.json);
--concurrency-only the many-sessions section alone (results/concurrency/<date>-<host>.json);
--pipeline adds the 3-worker shard route (one session, and 8 at once), --pipeline-only runs
it alone (results/pipeline/<date>-<host>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo (inference_engine)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (benchkit)

from benchkit.checks import print_failed, speed_checks  # noqa: E402
from benchkit.concurrency import aggregate_vs_single, measure_concurrency  # noqa: E402
from benchkit.core import (  # noqa: E402
    FULL,
    QUICK,
    ROOT,
    Contender,
    EngineResult,
    load_prompts,
    memory_bandwidth,
    run_interleaved,
    weight_bytes,
)
from benchkit.engines import (  # noqa: E402
    measure_append_latency,
    measure_pipeline,
    measure_rss,
    start_in_process,
    start_llama_cpp,
    start_mlx_lm,
    start_server,
)
from benchkit.report import batching_targets, build_report, fmt, print_table, q4_1_targets  # noqa: E402
from benchkit.snapshots import measure_snapshots, print_snapshots, snapshots_report  # noqa: E402

from inference_engine.blas import reexec_with_openblas  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run the bench; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    # mlx-lm runs in this process on MLX's own matmul: give it OpenBLAS (our engines' exact kernels need none)
    reexec_with_openblas([str(Path(__file__).resolve()), *argv])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seconds-long subset (CI)")
    parser.add_argument("--out", type=Path, help="JSON path (default results/bench/<date>-<host>.json)")
    parser.add_argument("--llama-cpp-build-s", type=float, help="record how long building llama-cpp-python took")
    parser.add_argument("--pipeline", action="store_true",
                        help="also measure decode over a 3-worker shard route vs one process, and per-hop latency")
    parser.add_argument("--snapshots-only", action="store_true",
                        help="only the session-snapshot section (results/snapshots/<date>-<host>.json)")
    parser.add_argument("--pipeline-only", action="store_true",
                        help="only the 3-worker shard route section (results/pipeline/<date>-<host>.json)")
    parser.add_argument("--concurrency-only", action="store_true",
                        help="only the many-sessions section, q4_1 and fp32 servers (results/concurrency/<date>-<host>.json)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL

    from inference_engine.config import default_cache_dir
    from inference_engine.model.packaged import ensure_packaged_model, packaged_gguf_path

    model_dir, gguf = ensure_packaged_model(default_cache_dir()), packaged_gguf_path()
    prompts = load_prompts(model_dir)
    t0, load_at_start = time.perf_counter(), os.getloadavg()  # other work on the machine skews every figure

    def phase(name: str) -> None:
        print(f"[bench {time.perf_counter() - t0:6.1f}s] {name}", file=sys.stderr, flush=True)

    if args.snapshots_only:
        phase("session snapshots only")
        report = snapshots_report(plan, args.quick, measure_snapshots(plan, prompts), t0, load_at_start)
        report["checks"] = speed_checks(report)
        out = write_section(report, "snapshots", args.out)
        print_snapshots(report["snapshots"])
        print_failed(report["checks"])
        print(f"\nwrote {out}")
        return 0
    phase("memory bandwidth")
    bandwidth = memory_bandwidth(plan.bandwidth_bytes, reps=2 if args.quick else 5)
    if args.concurrency_only:
        return concurrency_only(plan, prompts, bandwidth, args.out, phase)
    if args.pipeline_only:
        phase("shard pipeline only: 3 workers vs single process")
        report = {"meta": section_meta(), "bandwidth": bandwidth, "pipeline": measure_pipeline(plan, prompts)}
        out = write_section(report, "pipeline", args.out)
        print_pipeline(report["pipeline"])
        print(f"\nwrote {out}")
        return 0
    with ExitStack() as stack:
        phase("servers (q4_1, fp32): start, RSS, AppendTokens latency")
        contenders: dict[str, Contender] = {}
        server, contenders["server"] = start_server(plan, prompts, stack)
        server_fp32, contenders["server_fp32"] = start_server(plan, prompts, stack, weights="fp32")
        if not args.quick:  # the path before the exact-gemm kernel: fp32 weights, each row its own sgemv
            _, contenders["server_row_gemv"] = start_server(plan, prompts, stack, weights="fp32", kernel="row_gemv")
        rss, rss_fp32 = measure_rss(server, plan, prompts), measure_rss(server_fp32, plan, prompts)
        append = measure_append_latency(server, plan, prompts)
        phase(f"server: {plan.sessions} sessions at once, TTFT under load, head-of-line, prompt lookup")
        concurrency = measure_concurrency(server, prompts, plan)
        if not args.quick:  # the same on the fp32 weights (the exact-gemm kernel's own batching)
            phase(f"server_fp32: {plan.sessions} sessions at once, TTFT under load, head-of-line, prompt lookup")
            concurrency_fp32 = measure_concurrency(server_fp32, prompts, plan)
        phase("load in-process runtime, mlx_lm, llama.cpp")
        contenders["in_process"] = start_in_process(plan, prompts, stack)
        contenders["mlx_lm"] = start_mlx_lm(plan, prompts, model_dir)
        llama = start_llama_cpp(plan, prompts, gguf, stack)
        if isinstance(llama, Contender):
            contenders["llama_cpp"] = llama
        phase(f"decode and prefill, {plan.reps} repetitions interleaved over {', '.join(contenders)}")
        results = run_interleaved(contenders, plan)
        if isinstance(llama, Contender):
            phase(f"{plan.sessions} q4_1 sessions at once vs llama.cpp's single stream, alternated")
            aggregate_vs_llama = aggregate_vs_single(server, prompts, llama, plan.sessions, plan.new_tokens,
                                                     plan.reps if not args.quick else 1)
    if isinstance(llama, str):
        results["llama_cpp"] = EngineResult(False, llama)
    results["in_process"].extra["sample_text"] = prompts.tokenizer.decode(results["in_process"].decode[0].tokens)[:200]
    report = build_report(plan, args.quick, model_dir, gguf, bandwidth, weight_bytes(gguf), results, append, rss,
                          args.llama_cpp_build_s)
    report["server_rss_fp32"] = rss_fp32
    report["concurrency"] = concurrency
    if not args.quick:
        report["concurrency_fp32"] = concurrency_fp32
    if isinstance(llama, Contender):
        report["aggregate_vs_llama_cpp"] = aggregate_vs_llama
    report["q4_1"] = q4_1_targets(report)
    report["batching"] = batching_targets(report)
    phase("session snapshots: snapshot, restore, fork vs replay; restart with 8 persisted sessions")
    report["snapshots"] = measure_snapshots(plan, prompts)
    if args.pipeline:
        phase("shard pipeline: 3 workers vs single process")
        report["pipeline"] = measure_pipeline(plan, prompts)
    report["meta"].update(bench_wall_s=time.perf_counter() - t0, load_average_at_start=load_at_start)
    report["checks"] = speed_checks(report)  # the bench judges speed; the tests only its figures' shape

    out = args.out or ROOT / "results" / "bench" / f"{report['meta']['date']}-{report['meta']['host']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    c = report["concurrency"]
    print(f"{c['aggregate']['many']['sessions']} sessions at once: {c['aggregate']['many_over_one']:.2f}x the tok/s of one"
          f" (same stream: {c['aggregate']['first_stream_identical']}); TTFT with {c['ttft']['busy_sessions']} streaming:"
          f" {c['ttft']['loaded_over_idle']:.2f}x idle; longest gap while another session appends"
          f" {c['head_of_line']['append_tokens']} tokens: {c['head_of_line']['max_over_idle']:.2f}x the idle gap"
          f" (p99 {c['head_of_line']['p99_over_idle']:.2f}x);"
          f" prompt lookup K=4 on a copy-back prompt: {c['lookup']['lookup_over_greedy']:.2f}x greedy")
    q = report["q4_1"]
    print("q4_1: " + ", ".join(f"{k} {v:.2f}x (target {q['targets'][k]})" for k, v in q["ratios"].items())
          + f"; same tokens as fp32: {q['same_tokens_as_fp32']}")
    b = report["batching"]
    print("batching: " + ", ".join(f"{k} {v:.2f}x (target {b['targets'][k]})" for k, v in b["ratios"].items()))
    print_snapshots(report["snapshots"])
    if "pipeline" in report:
        print_pipeline(report["pipeline"])
    print_failed(report["checks"])
    print(f"\nwrote {out}")
    return 0


def section_meta() -> dict[str, str]:
    """Date and host of a one-section run (they name its JSON)."""
    return {"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename.split(".")[0]}


def write_section(report: dict[str, Any], section: str, out: Path | None) -> Path:
    """Write a one-section report to `out`, or to results/<section>/<date>-<host>.json; returns the path."""
    out = out or ROOT / "results" / section / f"{report['meta']['date']}-{report['meta']['host']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


def print_pipeline(p: dict[str, Any]) -> None:
    """The shard route's figures, one line each."""
    print(f"pipeline {'/'.join(p['ranges'])}: decode {fmt(p['pipeline']['decode_tok_s'])} tok/s vs single "
          f"process {fmt(p['single_process']['decode_tok_s'])} ({p['pipeline_over_single']:.2f}x); per hop ms "
          + ", ".join(f"{h['layers']} {h['mean_ms']:.2f}" for h in p["hops"]))
    for name in ("pipeline", "single_process"):
        a = p[name]["sessions_at_once"]
        print(f"{name}: {a['sessions']} sessions at once {a['many_tok_s']:.1f} tok/s, {a['many_over_one']:.2f}x one "
              f"({a['one_tok_s']:.1f})")
    print(f"same streams (route, one process, alone): {p['sessions_at_once_identical']}")


def concurrency_only(plan, prompts, bandwidth: dict, out: Path | None, phase: Callable[[str], None]) -> int:
    """The many-sessions figures alone (8 at once, TTFT under load, head-of-line, lookup), both weights."""
    report: dict[str, Any] = {"meta": section_meta(), "bandwidth": bandwidth}
    with ExitStack() as stack:
        for key, weights in (("concurrency", "q4_1"), ("concurrency_fp32", "fp32")):
            phase(f"{weights} server: {plan.sessions} sessions at once, TTFT under load, head-of-line, prompt lookup")
            server, _ = start_server(plan, prompts, stack, weights=weights)
            report[key] = measure_concurrency(server, prompts, plan)
    out = write_section(report, "concurrency", out)
    for key in ("concurrency", "concurrency_fp32"):
        c = report[key]
        print(f"{key}: 8 vs 1 {c['aggregate']['many_over_one']:.2f}x (same stream: {c['aggregate']['first_stream_identical']}),"
              f" TTFT loaded/idle {c['ttft']['loaded_over_idle']:.2f}x, head-of-line max {c['head_of_line']['max_over_idle']:.2f}x"
              f" (p99 {c['head_of_line']['p99_over_idle']:.2f}x), lookup K=4 {c['lookup']['lookup_over_greedy']:.2f}x")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

