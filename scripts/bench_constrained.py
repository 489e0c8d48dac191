#!/usr/bin/env python3
"""Constrained output's cost: tokens/s with a JSON-schema constraint vs without, same prompt, same run.

An in-process gRPC server over the packaged model (exact, the server's defaults). Arms: 1 and 8
concurrent sessions; in each, the constrained call runs first (greedy, until the JSON completes)
and the free call then generates exactly as many tokens (ignore_eos) on the same prompt. The mask's
own time (llguidance's compute_mask and consume, measured around TokenMatcher) is reported per
constrained token. Writes JSON to results/constrained/<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inference_engine.blas import reexec_with_openblas  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "tags", "steps"], "properties": {
    "title": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "minItems": 4, "maxItems": 4, "items": {"type": "string", "maxLength": 16}},
    "steps": {"type": "array", "minItems": 6, "maxItems": 6, "items": {"type": "string", "maxLength": 48}}}}
PROMPT = "Write a recipe for pancakes as JSON with a title, four tags and six steps."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])
    return asyncio.run(_bench(args))


async def _bench(args: argparse.Namespace) -> int:
    import dataclasses

    import grpc

    from inference_engine.blas import active_blas
    from inference_engine.config import ServerConfig, default_cache_dir
    from inference_engine.model.loader import load_model
    from inference_engine.model.packaged import ensure_packaged_model
    from inference_engine.runtime.engine import Engine
    from inference_engine.runtime.runtime import Runtime
    from inference_engine.server.server import start_server
    from inference_engine.text import constraint as constraint_module
    from inference_engine.v1 import runtime_pb2 as pb
    from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

    mask_s = [0.0]  # seconds inside llguidance's mask and consume calls (engine thread)
    for name in ("allowed", "consume", "valid_prefix"):
        original = getattr(constraint_module.TokenMatcher, name)

        def timed(self, *a, _original=original):
            t = time.perf_counter()
            try:
                return _original(self, *a)
            finally:
                mask_s[0] += time.perf_counter() - t

        setattr(constraint_module.TokenMatcher, name, timed)

    cfg = dataclasses.replace(ServerConfig(port=0), max_sessions=max(args.sessions) + 1, default_window=1024)
    loaded = load_model(ensure_packaged_model(default_cache_dir()))
    engine = Engine(loaded, cfg.exact, cfg.max_tile, cfg.plain_block, cfg.max_rollback)
    runtime = Runtime(engine, cfg)
    server, port = await start_server(runtime, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.RuntimeServiceStub(channel)
    constraint = pb.Constraint(json_schema=json.dumps(SCHEMA))

    async def session() -> str:
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, messages=[pb.ChatMessage(
            role="user", content=PROMPT)], add_generation_prompt=True))
        return sid

    async def generate(sid: str, n: int, constrained: bool) -> tuple[int, bool]:
        req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=not constrained)
        if constrained:
            req.constraint.CopyFrom(constraint)
        msgs = [m async for m in stub.Generate(req)]
        text = "".join(m.text for m in msgs)
        is_valid = True
        if constrained:
            try:
                json.loads(text)
            except ValueError:
                is_valid = False
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        return sum(len(m.tokens) for m in msgs), is_valid

    arms: dict = {}
    try:
        await generate(await session(), 8, True)  # warm: llguidance's tokenizer, the kernels
        for n_sessions in args.sessions:
            rates: dict[str, list[float]] = {"constrained": [], "free": []}
            per_token_mask_us, tokens, valid = [], 0, True
            for _ in range(args.reps):
                sids = [await session() for _ in range(n_sessions)]
                mask_s[0] = 0.0
                t = time.perf_counter()
                got = await asyncio.gather(*(generate(s, args.max_tokens, True) for s in sids))
                rates["constrained"].append(sum(n for n, _ in got) / (time.perf_counter() - t))
                per_token_mask_us.append(mask_s[0] / sum(n for n, _ in got) * 1e6)
                valid &= all(ok for _, ok in got)
                tokens = round(statistics.mean(n for n, _ in got))
                sids = [await session() for _ in range(n_sessions)]
                t = time.perf_counter()
                free = await asyncio.gather(*(generate(s, n, False) for s, (n, _) in zip(sids, got)))
                rates["free"].append(sum(n for n, _ in free) / (time.perf_counter() - t))
            c, f = statistics.median(rates["constrained"]), statistics.median(rates["free"])
            arms[f"sessions={n_sessions}"] = {
                "tokens_per_s": {"constrained": c, "free": f, "all": rates},
                "overhead": 1 - c / f, "mask_us_per_token": statistics.median(per_token_mask_us),
                "tokens_per_session": tokens, "all_json_valid": valid,
            }
            print(f"{n_sessions} sessions: constrained {c:7.2f} tok/s, free {f:7.2f} tok/s, overhead {1 - c / f:6.1%}, "
                  f"mask {statistics.median(per_token_mask_us):7.1f} us/token, {tokens} tokens/session", flush=True)
    finally:
        await channel.close()
        await server.stop(0.5)
        await runtime.stop()
        engine.close()
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
              "blas": active_blas(), "model": loaded.spec.name, "schema": SCHEMA, "prompt": PROMPT, "reps": args.reps,
              "arms": arms}
    out = args.out or Path("results/constrained") / f"{datetime.now():%Y-%m-%d}-{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"-> {out}")
    return 0 if all(a["all_json_valid"] for a in arms.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
