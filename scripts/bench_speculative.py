#!/usr/bin/env python3
"""Speculative vs greedy decoding through the gRPC server, same run, same model.

Workloads: (a) repetitive — the answer quotes the prompt (a code snippet to copy back);
(b) free text — an open question. Arms: GREEDY, SPECULATIVE_LOOKUP and
SPECULATIVE_DRAFT (the packaged Q4 model drafting for its fp32 form), each K given.
Reports tokens/s (median of reps, min-max), speedup vs greedy, acceptance rate
(accepted / drafted). Writes JSON to results/speculative/<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (benchkit)
from benchkit.core import COPY_BACK as CODE  # noqa: E402
from inference_engine.blas import reexec_with_openblas  # noqa: E402

WORKLOADS = {
    "repetitive": "Copy the following Python code exactly, without any change or comment:\n\n" + CODE,
    "free_text": "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
}
MODES = {"greedy": 0, "draft": 1, "lookup": 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])

    import grpc
    from transformers import AutoTokenizer

    from inference_engine.blas import active_blas
    from inference_engine.config import default_cache_dir
    from inference_engine.model.packaged import ensure_packaged_model
    from inference_engine.v1 import runtime_pb2 as pb
    from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

    tok = AutoTokenizer.from_pretrained(str(ensure_packaged_model(default_cache_dir())))
    server = subprocess.Popen(
        [sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--max-sessions", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ),
    )
    target = server.stdout.readline().split()[-1]
    stub = pb_grpc.RuntimeServiceStub(grpc.insecure_channel(target))
    results: dict = {}
    try:
        for wname, text in WORKLOADS.items():
            prompt = tok.encode(
                tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )
            arms = [("greedy", 1)] + [(m, k) for m in args.modes if m != "greedy" for k in args.k]
            for mode, k in arms:
                rates, drafted, accepted, streams = [], 0, 0, []
                for _ in range(args.reps):
                    sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
                    stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=prompt))
                    t = time.perf_counter()
                    got, last = [], None
                    req = pb.GenerateRequest(session_id=sid, max_new_tokens=args.tokens, ignore_eos=True,
                                             mode=MODES[mode], num_draft_tokens=k)
                    for msg in stub.Generate(req):
                        got += list(msg.tokens)
                        last = msg
                    rates.append(len(got) / (time.perf_counter() - t))
                    drafted += last.drafted_tokens
                    accepted += last.accepted_tokens
                    streams.append(got)
                    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
                key = f"{wname}/{mode}" + (f"/K={k}" if mode != "greedy" else "")
                results[key] = {
                    "tokens_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
                    "acceptance": accepted / drafted if drafted else None,
                    "drafted": drafted, "accepted": accepted,
                    "identical_to_greedy": streams[0] == results.get(f"{wname}/greedy", {}).get("_stream", streams[0]),
                    "_stream": streams[0],
                }
                print(f"{key:28} {statistics.median(rates):7.2f} tok/s  acceptance {results[key]['acceptance']}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    for key, r in results.items():
        base = results[key.split("/")[0] + "/greedy"]["tokens_per_s"]["median"]
        r["speedup_vs_greedy"] = r["tokens_per_s"]["median"] / base
    for r in results.values():
        r.pop("_stream")
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
        "blas": active_blas(), "new_tokens": args.tokens, "reps": args.reps, "arms": results,
    }
    out = args.out or Path("results/speculative") / f"{datetime.now():%Y-%m-%d}-{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"{'arm':28} {'tok/s':>7} {'speedup':>8} {'accept':>7}")
    for key, r in results.items():
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        print(f"{key:28} {r['tokens_per_s']['median']:7.2f} {r['speedup_vs_greedy']:7.2f}x {acc:>7}")
    print(f"-> {out}")
    return 0 if all(r["identical_to_greedy"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
