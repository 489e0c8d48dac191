#!/usr/bin/env python3
"""What authenticating the spawned shard route costs: greedy decode tok/s, mTLS + token vs plaintext + token.

- mtls: `--spawn-shards 0:10,10:20,20:30` as the server runs it (the supervisor's own CA,
  mTLS both ways, the bearer token inside).
- plaintext: the same three ranges as `shard-worker` processes requiring the same kind of
  token over plaintext (what spawned workers were before issue 28).
Both routes are driven by their own Runtime in this process, interleaved repetition by
repetition; the tokens must be identical. Writes results/pipeline/<date>-<host>-shard-auth.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from inference_engine.blas import reexec_with_openblas  # noqa: E402

RANGES = ("0:10", "10:20", "20:30")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])

    from benchkit.core import load_prompts, summary
    from benchkit.engines import runtime_decode, tear_down

    from inference_engine.config import ServerConfig, default_cache_dir
    from inference_engine.model.packaged import ensure_packaged_model
    from inference_engine.readiness import wait_ready
    from inference_engine.runtime.runtime import Runtime
    from inference_engine.security.settings import ClientSecurity
    from inference_engine.server.server import build_engine, connect_shards

    prompts = load_prompts(ensure_packaged_model(default_cache_dir()))
    cfg = ServerConfig(port=0, max_sessions=2, draft_model=None)
    engines = {"plaintext": build_engine(cfg), "mtls": build_engine(cfg)}
    block = engines["plaintext"].block
    token = secrets.token_hex(32)
    folder = Path(tempfile.mkdtemp(prefix="bench-shard-auth-"))
    (folder / "token.txt").write_text(token + "\n")
    workers = [subprocess.Popen([sys.executable, "-m", "inference_engine", "shard-worker", "--layers", r, "--port", "0",
                                 "--block", str(block), "--max-sessions", "4", "--auth-token-file",
                                 str(folder / "token.txt")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
               for r in RANGES]
    loop = asyncio.new_event_loop()
    decode: dict[str, list[float]] = {"plaintext": [], "mtls": []}
    tokens: dict[str, list[list[int]]] = {"plaintext": [], "mtls": []}
    try:
        addresses = tuple(wait_ready(w) for w in workers)
        plain_route, _ = loop.run_until_complete(connect_shards(
            replace(cfg, shards=addresses, shard_security=ClientSecurity(token=token)), engines["plaintext"]))
        mtls_route, supervisor = loop.run_until_complete(connect_shards(replace(cfg, spawn_shards=RANGES),
                                                                        engines["mtls"]))
        runtimes = {name: Runtime(e, cfg) for name, e in engines.items()}
        for runtime in runtimes.values():  # warm-up
            loop.run_until_complete(runtime_decode(runtime, prompts, 8))
        for _ in range(args.reps):
            for name, runtime in runtimes.items():
                trace = loop.run_until_complete(runtime_decode(runtime, prompts, args.new_tokens))
                decode[name].append(trace.decode_tok_s)
                tokens[name].append(trace.tokens)
        for route in (plain_route, mtls_route):
            loop.run_until_complete(route.stop())
        loop.run_until_complete(supervisor.stop())
    finally:
        tear_down(loop, engines, workers)
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
        "command": " ".join(["scripts/bench_shard_auth.py", *sys.argv[1:]]), "ranges": list(RANGES), "block": block,
        "new_tokens": args.new_tokens, "reps": args.reps,
        "decode_tok_s": {name: summary(values) for name, values in decode.items()},
        "tokens_identical": tokens["plaintext"] == tokens["mtls"],
    }
    out["mtls_over_plaintext"] = out["decode_tok_s"]["mtls"]["median"] / out["decode_tok_s"]["plaintext"]["median"]
    path = args.out or REPO / "results" / "pipeline" / f"{datetime.now():%Y-%m-%d}-{socket.gethostname()}-shard-auth.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("decode_tok_s", "mtls_over_plaintext", "tokens_identical")}, indent=1))
    print(f"-> {path}")
    return 0 if out["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
