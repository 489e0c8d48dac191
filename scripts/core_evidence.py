#!/usr/bin/env python3
"""Evidence for the runtime core on the packaged model, through a real gRPC server.

1. Greedy parity: for several chat prompts, 32 greedy tokens from the server equal
   mlx-lm's own `generate_step` on the same weights.
2. Bounded memory: one session (sink 4, window 32) fed 11 x 32 tokens; per-session KV
   bytes and MLX active memory after each append.
Writes results/core/<date>-<host>.json.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inference_engine.blas import reexec_with_openblas  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three uses of a paperclip.",
]


async def main() -> int:
    import grpc
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    from inference_engine.blas import active_blas
    from inference_engine.config import ServerConfig, default_cache_dir
    from inference_engine.model.loader import load_model
    from inference_engine.model.packaged import ensure_packaged_model
    from inference_engine.runtime.engine import Engine
    from inference_engine.runtime.runtime import Runtime
    from inference_engine.server.server import start_server
    from inference_engine.v1 import runtime_pb2 as pb
    from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

    loaded = load_model(ensure_packaged_model(default_cache_dir()))
    engine = Engine(loaded, exact=True, max_tile=16, plain_block=64, max_rollback=8)
    runtime = Runtime(engine, ServerConfig(port=0))
    server, port = await start_server(runtime, "127.0.0.1", 0)
    tok = loaded.tokenizer
    parity = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.RuntimeServiceStub(ch)
        for q in QUESTIONS:
            text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            prompt = tok.encode(text, add_special_tokens=False)
            ref = [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), loaded.model, max_tokens=32), range(32))]
            sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=prompt))
            got = []
            async for m in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=32, ignore_eos=True)):
                got += list(m.tokens)
            await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            parity.append({"question": q, "prompt_tokens": len(prompt), "server": got, "mlx_lm": ref,
                           "equal": got == ref, "text": tok.decode(got)})
            print(f"{'EQUAL' if got == ref else 'DIFFERENT'}: {q!r} -> {tok.decode(got)!r}", flush=True)
        sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=4, window_tokens=32))).session_id
        rng = np.random.default_rng(3)
        memory = []
        for _ in range(11):
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=rng.integers(0, 49152, 32).tolist()))
            info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
            memory.append({"history": info.history_length, "cached_tokens": info.cached_tokens,
                           "kv_bytes": info.kv_bytes, "mlx_active_bytes": mx.get_active_memory()})
            print(memory[-1], flush=True)
    await server.stop(0)
    await runtime.stop()
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
        "blas": active_blas(), "exact_tile": engine.block, "greedy_parity": parity, "memory_sink4_window32": memory,
        "memory_growth_after_first_window_bytes": memory[-1]["mlx_active_bytes"] - memory[1]["mlx_active_bytes"],
    }
    out = Path("results/core") / f"{datetime.now():%Y-%m-%d}-{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"-> {out}")
    return 0 if all(p["equal"] for p in parity) else 1


if __name__ == "__main__":
    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])
    from inference_engine.process_exit import exit_now

    exit_now(asyncio.run(main()))
