#!/usr/bin/env python3
"""Speculative-session exactness gates (the seeds' memra battery) on the real model.

For each drafter (draft model, prompt lookup) and K in {1, 4, 8}, over a real grpc.aio
server with a window small enough to wrap during generation:
- gate1: for burst widths w in {1, K-1, K, K+1, 32}, the stream reassembled from
  Generate calls of max_new_tokens=w equals one-shot speculative generation;
- gate2: every such stream equals plain greedy, and the state digest (next-token logits,
  cached K/V, tokens, position) after every burst equals greedy's at that position;
- gate3: 16 speculative tokens, then demote to GREEDY: the whole stream equals greedy;
- invariants after every arm: cache rows == committed tokens (position == history
  length, cached tokens == min(history, sink + window)); the emitted stream is a prefix
  of the committed history.
Prints one `ok:`/`FAIL:` line per check and `ALL GREEN` (exit 0) only if all pass.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference_engine.blas import reexec_with_openblas  # noqa: E402

MODES = {"draft": 1, "lookup": 2}  # DecodeMode values of the proto
PROMPT_TEXT = (
    "Copy this list exactly, twice: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. "
    "Then continue counting: one two three four five six seven eight nine ten."
)


@dataclass
class GateReport:
    """Outcome lines of a gate run."""

    lines: list[str] = field(default_factory=list)
    failures: int = 0

    def check(self, ok: bool, what: str) -> None:
        self.lines.append(("ok: " if ok else "FAIL: ") + what)
        self.failures += 0 if ok else 1
        print(self.lines[-1], flush=True)


async def _new_session(stub, pb, prompt: list[int], sink: int, window: int) -> str:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=sink, window_tokens=window))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=prompt))
    return sid


async def _burst(stub, pb, sid: str, n: int, mode: int, k: int) -> tuple[list[int], object]:
    tokens, last = [], None
    req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, mode=mode, num_draft_tokens=k)
    async for msg in stub.Generate(req):
        tokens += list(msg.tokens)
        last = msg
    return tokens, last


async def _arm(stub, pb, runtime, prompt, n, plan, sink, window, report, label) -> tuple[list[int], dict[int, str], tuple[int, int]]:
    """Generate n tokens in bursts `plan` = [(width, mode, k)...] repeated; returns stream, digests by position, counts."""
    sid = await _new_session(stub, pb, prompt, sink, window)
    stream: list[int] = []
    digests: dict[int, str] = {}
    drafted = accepted = 0
    i = 0
    while len(stream) < n:
        width, mode, k = plan[min(i, len(plan) - 1)]
        got, last = await _burst(stub, pb, sid, min(width, n - len(stream)), mode, k)
        stream += got
        drafted, accepted = drafted + last.drafted_tokens, accepted + last.accepted_tokens
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        digests[info.history_length] = info.state_digest
        i += 1
    history = runtime.store.get(sid).history
    report.check(
        info.next_global_position == info.history_length == len(prompt) + len(stream)
        and info.cached_tokens == min(info.history_length, sink + window),
        f"{label}: cache rows == committed tokens ({info.next_global_position} positions, {info.cached_tokens} cached)",
    )
    report.check(history[len(prompt) :][: len(stream)] == stream, f"{label}: emitted stream is a prefix of the committed history")
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return stream, digests, (drafted, accepted)


async def run_gates(stub, pb, runtime, prompt: list[int], drafters: list[str], ks: list[int], n: int, sink: int, window: int) -> GateReport:
    """Run every gate over an open stub; `runtime` is the in-process Runtime behind it."""
    report = GateReport()
    greedy, greedy_digests, _ = await _arm(stub, pb, runtime, prompt, n, [(1, 0, 1)], sink, window, report, "greedy w=1")
    report.check(len(prompt) + n > sink + window, f"window wraps during generation ({len(prompt)} + {n} > {sink} + {window})")
    for name in drafters:
        mode = MODES[name]
        for k in ks:
            tag = f"{name} K={k}"
            one_shot, _, (d, a) = await _arm(stub, pb, runtime, prompt, n, [(n, mode, k)], sink, window, report, f"{tag} one-shot")
            report.check(one_shot == greedy, f"{tag} one-shot equals greedy (accepted {a}/{d} drafts)")
            for w in sorted({max(1, k - 1), k, k + 1, 1, 32}):
                stream, digests, (d, a) = await _arm(stub, pb, runtime, prompt, n, [(w, mode, k)], sink, window, report, f"{tag} w={w}")
                report.check(stream == one_shot, f"gate1 {tag} w={w}: bursts reassemble to one-shot ({a}/{d} accepted)")
                report.check(stream == greedy, f"gate2 {tag} w={w}: stream equals greedy")
                same = all(greedy_digests[p] == dg for p, dg in digests.items())
                report.check(same, f"gate2 {tag} w={w}: state digest equals greedy's at all {len(digests)} burst ends")
            demote = [(16, mode, k), (n, 0, k)]
            stream, digests, _ = await _arm(stub, pb, runtime, prompt, n, demote, sink, window, report, f"{tag} demote")
            report.check(stream == greedy and all(greedy_digests[p] == dg for p, dg in digests.items()),
                         f"gate3 {tag}: 16 speculative then greedy equals greedy")
    return report


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
    engine = Engine(target, exact=True, max_tile=16, plain_block=64, max_rollback=8, draft=draft)
    runtime = Runtime(engine, ServerConfig(port=0))
    server, port = await start_server(runtime, "127.0.0.1", 0)
    tok = target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    print(f"prompt {len(prompt)} tokens, {args.tokens} generated, sink {args.sink} + window {args.window}, tile {engine.block}")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        report = await run_gates(pb_grpc.RuntimeServiceStub(channel), pb, runtime, prompt, args.drafters, args.k, args.tokens, args.sink, args.window)
    await server.stop(0)
    await runtime.stop()
    total = len(report.lines)
    print(f"{total - report.failures} passed, {report.failures} failed")
    if report.failures == 0:
        print("ALL GREEN")
    return 0 if report.failures == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", nargs="+", default=["lookup", "draft"], choices=sorted(MODES))
    parser.add_argument("--k", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=32)
    args = parser.parse_args()
    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])
    from inference_engine.process_exit import exit_now

    exit_now(asyncio.run(_main(args)))  # MLX ran on an engine thread: leave without C++ teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
