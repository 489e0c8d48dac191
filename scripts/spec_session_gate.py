#!/usr/bin/env python3
"""Speculative-session exactness gates (the seeds' memra battery) on the real model.

For each sampling setting (greedy; seeded sampling), each drafter (the q4 draft model, prompt
lookup, and "self": the target as its own draft model, on a second server) and K in {1, 4, 8},
over a real grpc.aio server with a window small enough to wrap during generation ("plain"
below is non-speculative decoding with the same sampling parameters: greedy, or the same
seeded draws), on a prompt the model copies:
- gate1: for burst widths w in {K-1, K, K+1, 32} (at least 2), the stream reassembled from
  Generate calls of max_new_tokens=w equals one-shot speculative generation;
- gate2: every such stream equals plain decoding, and the state digest (next-token logits,
  cached K/V, tokens, position) after every burst equals plain decoding's at that position;
- gate3: 16 speculative tokens, then demote to plain decoding: the whole stream equals plain;
- invariants after every arm: cache rows == committed tokens (position == history
  length, cached tokens == min(history, sink + window)); the emitted stream is a prefix
  of the committed history.
Every speculative arm prints its drafted and accepted counts and fails when it drafted nothing;
each drafter fails unless some arm accepted a draft; the run fails unless some arm accepted
part of its drafts and some arm all of them.
Prints one `ok:`/`FAIL:` line per check and `ALL GREEN` (exit 0) only if all pass.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference_engine.blas import reexec_with_openblas  # noqa: E402
from inference_engine.client.spec_gates import MODES, PROMPT_TEXT, SAMPLINGS, GateReport, run_gates  # noqa: E402


async def _main(args: argparse.Namespace) -> int:
    import grpc

    from inference_engine.config import default_cache_dir
    from inference_engine.model.loader import load_model
    from inference_engine.model.packaged import ensure_packaged_model
    from inference_engine.runtime.engine import Engine
    from inference_engine.runtime.runtime import Runtime
    from inference_engine.server.server import start_server
    from inference_engine.config import ServerConfig
    from inference_engine.v1 import runtime_pb2 as pb
    from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

    cache = default_cache_dir()
    target = load_model(ensure_packaged_model(cache))
    draft = load_model(ensure_packaged_model(cache, quantized=True))
    tok = target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    report = GateReport()
    # "self" needs a server whose draft model is the target; the other drafters share one with the q4 draft.
    groups = [(draft, [d for d in args.drafters if d != "self"]), (target, [d for d in args.drafters if d == "self"])]
    for draft_model, drafters in groups:
        if not drafters:
            continue
        engine = Engine(target, exact=True, max_tile=16, plain_block=64, max_rollback=8, draft=draft_model)
        runtime = Runtime(engine, ServerConfig(port=0))
        server, port = await start_server(runtime, "127.0.0.1", 0)
        print(f"prompt {len(prompt)} tokens, {args.tokens} generated, sink {args.sink} + window {args.window}, "
              f"tile {engine.block}, drafters {', '.join(drafters)}, "
              f"sampling {', '.join(f'{s} {SAMPLINGS[s]}' for s in args.sampling)}")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            history_of = lambda sid, rt=runtime: rt.store.get(sid).history  # noqa: E731
            await run_gates(pb_grpc.RuntimeServiceStub(channel), pb, history_of, prompt, drafters, args.k, args.tokens,
                            args.sink, args.window, args.sampling, report)
        await server.stop(0)
        await runtime.stop()
    report.check_reached(("partial", "full"))
    for arm in report.arms:
        print(f"counts {arm.label}: drafted {arm.drafted}, accepted {arm.accepted}")
    total = len(report.lines)
    print(f"{total - report.failures} passed, {report.failures} failed")
    if report.failures == 0:
        print("ALL GREEN")
    return 0 if report.failures == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", nargs="+", default=["lookup", "draft", "self"], choices=sorted(MODES),
                        help="self: the target as its own draft model (%(default)s)")
    parser.add_argument("--k", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--sampling", nargs="+", default=list(SAMPLINGS), choices=list(SAMPLINGS),
                        help="greedy and/or seeded sampling (%(default)s)")
    args = parser.parse_args()
    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])
    from inference_engine.process_exit import exit_now

    exit_now(asyncio.run(_main(args)))  # MLX ran on an engine thread: leave without C++ teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
