"""Does the launcher's OpenBLAS preload (and its re-exec) still help? Start-up and decode, with and without.

Every exact product goes through the exact kernels' MLX primitives, so the launcher no longer
re-execs where they are built. This measures what the old arrangement would still buy, in one
run, arms alternating so the machine's drift spreads over both:
- no_preload: `python -m inference_engine serve` with no LD_PRELOAD (the launcher's default now);
- preload: the same with INFERENCE_ENGINE_OPENBLAS=1 (the launcher re-execs once with the
  exact-gemm interposer and OpenBLAS preloaded, as it always did before).
Each arm serves the packaged SmolLM2-135M in exact mode and in plain mode (--no-exact), fp32
weights (the products this change moved) and q4_1 (the default). Per server: seconds from
spawn to the readiness line, a 256-token prefill and 32-token greedy decodes (medians).

    .venv/bin/python scripts/bench_preload.py [--rounds 2] [--out results/preload_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchkit.core import memory_bandwidth  # noqa: E402
from benchkit.report import cpu_name  # noqa: E402
from inference_engine.readiness import wait_ready  # noqa: E402

ARMS = {"no_preload": {}, "preload": {"INFERENCE_ENGINE_OPENBLAS": "1"}}
PROMPT = [(11 * i + 5) % 40000 + 100 for i in range(256)]


def one_server(arm: str, mode: str, weights: str, decodes: int) -> dict:
    """Start a server in `arm`, measure it, stop it."""
    import grpc

    from inference_engine.v1 import runtime_pb2 as pb
    from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("INFERENCE_ENGINE_")}
    env.update(ARMS[arm])
    cmd = [sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--weights", weights,
           "--draft-model", "none", "--max-sessions", "2", "--default-window", "512",
           *(["--no-exact"] if mode == "plain" else [])]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            address = wait_ready(proc)
            startup_s = time.perf_counter() - start
            with grpc.insecure_channel(address) as channel:
                stub = pb_grpc.RuntimeServiceStub(channel)
                info = stub.GetModelInfo(pb.GetModelInfoRequest())
                prefill, decode = [], []
                for _ in range(decodes):
                    sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
                    t = time.perf_counter()
                    stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
                    prefill.append(time.perf_counter() - t)
                    t, n = time.perf_counter(), 0
                    for m in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=32, ignore_eos=True)):
                        n += len(m.tokens)
                    decode.append(n / (time.perf_counter() - t))
                    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        log.seek(0)
        blas = next((line.split("BLAS in use: ", 1)[1] for line in log.read().splitlines() if "BLAS in use: " in line),
                    "unknown")
    return {"arm": arm, "mode": mode, "weights": weights, "startup_s": startup_s,
            "prefill_256_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "exact": info.exact, "block_size": info.block_size, "kernels": info.kernels, "blas": blas}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="servers per arm, mode and weights (alternating)")
    parser.add_argument("--decodes", type=int, default=3, help="prefill + decode repetitions per server")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "preload_bench.json")
    args = parser.parse_args()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "cpu": cpu_name(), "cores": os.cpu_count(),
            "loadavg_before": os.getloadavg(), "bandwidth": memory_bandwidth(256 << 20, 3),
            "command": " ".join([".venv/bin/python", "scripts/bench_preload.py", *sys.argv[1:]])}
    runs = []
    for r in range(args.rounds):
        for mode in ("exact", "plain"):
            for weights in ("fp32", "q4_1"):
                for arm in (ARMS if r % 2 == 0 else reversed(list(ARMS))):
                    runs.append({"round": r, **one_server(arm, mode, weights, args.decodes)})
                    print(json.dumps(runs[-1]), flush=True)
    meta["loadavg_after"] = os.getloadavg()
    summary = {}
    for mode in ("exact", "plain"):
        for weights in ("fp32", "q4_1"):
            for arm in ARMS:
                mine = [x for x in runs if (x["arm"], x["mode"], x["weights"]) == (arm, mode, weights)]
                summary[f"{mode}/{weights}/{arm}"] = {
                    k: statistics.median(x[k] for x in mine) for k in ("startup_s", "prefill_256_s", "decode_tok_s")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
