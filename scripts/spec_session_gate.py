#!/usr/bin/env python3
"""Speculative-session exactness gates (the seeds' memra battery) on the real model.

For each sampling setting (greedy; seeded sampling), each drafter (draft model, prompt
lookup) and K in {1, 4, 8}, over a real grpc.aio server with a window small enough to wrap
during generation ("plain" below is non-speculative decoding with the same sampling
parameters: greedy, or the same seeded draws):
- gate1: for burst widths w in {1, K-1, K, K+1, 32}, the stream reassembled from
  Generate calls of max_new_tokens=w equals one-shot speculative generation;
- gate2: every such stream equals plain decoding, and the state digest (next-token logits,
  cached K/V, tokens, position) after every burst equals plain decoding's at that position;
- gate3: 16 speculative tokens, then demote to plain decoding: the whole stream equals plain;
- invariants after every arm: cache rows == committed tokens (position == history
  length, cached tokens == min(history, sink + window)); the emitted stream is a prefix
  of the committed history.
Prints one `ok:`/`FAIL:` line per check and `ALL GREEN` (exit 0) only if all pass.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference_engine.blas import reexec_with_openblas  # noqa: E402

MODES = {"draft": 1, "lookup": 2}  # DecodeMode values of the proto
# GenerateRequest sampling fields of each setting the gates run under.
SAMPLINGS = {
    "greedy": {},
    "seeded": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.1, "seed": 1234},
}
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


async def _burst(stub, pb, sid: str, n: int, mode: int, k: int, sampling: dict) -> tuple[list[int], object]:
    tokens, last = [], None
    req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, mode=mode, num_draft_tokens=k, **sampling)
    async for msg in stub.Generate(req):
        tokens += list(msg.tokens)
        last = msg
    return tokens, last


async def _arm(stub, pb, runtime, prompt, n, plan, sink, window, report, label, sampling) -> tuple[list[int], dict[int, str], tuple[int, int]]:
    """Generate n tokens in bursts `plan` = [(width, mode, k)...] repeated; returns stream, digests by position, counts."""
    sid = await _new_session(stub, pb, prompt, sink, window)
    stream: list[int] = []
    digests: dict[int, str] = {}
    drafted = accepted = 0
    i = 0
    while len(stream) < n:
        width, mode, k = plan[min(i, len(plan) - 1)]
        got, last = await _burst(stub, pb, sid, min(width, n - len(stream)), mode, k, sampling)
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


async def run_gates(stub, pb, runtime, prompt: list[int], drafters: list[str], ks: list[int], n: int, sink: int,
                    window: int, samplings: list[str] = ("greedy",)) -> GateReport:
    """Run every gate over an open stub for each sampling setting; `runtime` is the in-process Runtime behind it."""
    report = GateReport()
    for setting in samplings:
        await _gates(stub, pb, runtime, prompt, drafters, ks, n, sink, window, report, setting, SAMPLINGS[setting])
    return report


async def _gates(stub, pb, runtime, prompt, drafters, ks, n, sink, window, report, setting, sampling) -> None:
    arm = functools.partial(_arm, stub, pb, runtime, prompt, n, sink=sink, window=window, report=report, sampling=sampling)
    plain, plain_digests, _ = await arm([(1, 0, 1)], label=f"{setting} plain w=1")
    report.check(len(prompt) + n > sink + window, f"window wraps during generation ({len(prompt)} + {n} > {sink} + {window})")
    if sampling:
        greedy, _, _ = await _arm(stub, pb, runtime, prompt, n, [(n, 0, 1)], sink, window, report, "greedy reference", {})
        report.check(plain != greedy, f"{setting}: seeded sampling departs from greedy (a real draw)")
    for name in drafters:
        mode = MODES[name]
        for k in ks:
            tag = f"{setting} {name} K={k}"
            one_shot, _, (d, a) = await arm([(n, mode, k)], label=f"{tag} one-shot")
            report.check(one_shot == plain, f"{tag} one-shot equals plain (accepted {a}/{d} drafts)")
            for w in sorted({max(1, k - 1), k, k + 1, 1, 32}):
                stream, digests, (d, a) = await arm([(w, mode, k)], label=f"{tag} w={w}")
                report.check(stream == one_shot, f"gate1 {tag} w={w}: bursts reassemble to one-shot ({a}/{d} accepted)")
                report.check(stream == plain, f"gate2 {tag} w={w}: stream equals plain")
                same = all(plain_digests[p] == dg for p, dg in digests.items())
                report.check(same, f"gate2 {tag} w={w}: state digest equals plain's at all {len(digests)} burst ends")
            stream, digests, _ = await arm([(16, mode, k), (n, 0, k)], label=f"{tag} demote")
            report.check(stream == plain and all(plain_digests[p] == dg for p, dg in digests.items()),
                         f"gate3 {tag}: 16 speculative then plain equals plain")


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
    print(f"prompt {len(prompt)} tokens, {args.tokens} generated, sink {args.sink} + window {args.window}, "
          f"tile {engine.block}, sampling {', '.join(f'{s} {SAMPLINGS[s]}' for s in args.sampling)}")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        report = await run_gates(pb_grpc.RuntimeServiceStub(channel), pb, runtime, prompt, args.drafters, args.k,
                                 args.tokens, args.sink, args.window, args.sampling)
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
    parser.add_argument("--sampling", nargs="+", default=list(SAMPLINGS), choices=list(SAMPLINGS),
                        help="greedy and/or seeded sampling (%(default)s)")
    args = parser.parse_args()
    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])
    from inference_engine.process_exit import exit_now

    exit_now(asyncio.run(_main(args)))  # MLX ran on an engine thread: leave without C++ teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
