#!/usr/bin/env python3
"""Where a stream's worst inter-token gaps go (issue 28): the server's engine step, its hand-over, or the client.

    .venv/bin/python scripts/profile_stream_gaps.py --rounds 3 --out results/reliability/<date>-vm-stream-gaps.json

Against a real `serve` process whose engine loop is timestamped (a sitecustomize in the child
only: it wraps `Scheduler.step`, `GenerateJob.post` and `GenerateJob.hand`), a greedy stream alone,
then beside another process's back-to-back maximal Tokenize calls (reliabilitykit.text_stall's
other client), alternated. Each gap between two tokens the client received splits into:
- wake: the previous hand-over to the engine thread's next iteration;
- step: that iteration's plan, forward and update until the token is posted to the loop;
- hand: posted until the stream's coroutine took it (the event loop's delay);
- client: taken until the client read it, less the same for the previous token.
Per phase: the gaps' median and worst, the components' medians, and the worst gaps split.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from inference_engine.security.credentials import open_channel  # noqa: E402
from inference_engine.v1 import runtime_pb2 as pb  # noqa: E402
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc  # noqa: E402
from reliabilitykit import text_stall  # noqa: E402
from reliabilitykit.server_process import ServerProcess  # noqa: E402

TRACER = '''
import os, sys, threading, time
_out = open(os.environ["STREAM_GAP_TRACE"], "a", buffering=1)
def _mark(kind):
    _out.write(f"{kind} {time.time():.6f}\\n")
def _wrap(owner, name, kind):
    original = getattr(owner, name)
    def timed(*args, **kwargs):
        _mark(kind)
        return original(*args, **kwargs)
    setattr(owner, name, timed)
def _patch():
    while not {"inference_engine.runtime.jobs", "inference_engine.runtime.scheduler"} <= set(sys.modules):
        time.sleep(0.01)
    time.sleep(0.5)  # both modules finished importing
    _wrap(sys.modules["inference_engine.runtime.scheduler"].Scheduler, "step", "S")
    jobs = sys.modules["inference_engine.runtime.jobs"].GenerateJob
    _wrap(jobs, "post", "P")
    _wrap(jobs, "hand", "H")
threading.Thread(target=_patch, daemon=True).start()
'''


async def _stream(stub: pb_grpc.RuntimeServiceStub, n: int) -> list[float]:
    """Wall times at which each token message of one greedy stream arrived."""
    sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=text_stall.PROMPT))
    arrived = []
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True)):
        if msg.tokens:
            arrived.append(time.time())
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return arrived


async def _beside(stub: pb_grpc.RuntimeServiceStub, target: str, n: int) -> list[float]:
    other = await asyncio.create_subprocess_exec(
        sys.executable, "-m", text_stall.__name__, target, str(text_stall.StallPlan.max_text_chars),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": f"{REPO / 'scripts'}{os.pathsep}{REPO}"})
    assert other.stdin is not None and other.stdout is not None
    await other.stdout.readline()  # its first Tokenize was answered
    try:
        return await _stream(stub, n)
    finally:
        other.stdin.close()
        await other.communicate()


def split(arrived: list[float], events: dict[str, list[float]]) -> list[dict[str, float]]:
    """Each gap (ms) and its components, from the server's events around each token."""
    def before(kind: str, t: float) -> float | None:  # the last event of `kind` at or before t (None: none)
        i = bisect.bisect_right(events[kind], t) - 1
        return events[kind][i] if i >= 0 else None

    def after(kind: str, t: float) -> float | None:  # the first event of `kind` at or after t (None: none)
        i = bisect.bisect_left(events[kind], t)
        return events[kind][i] if i < len(events[kind]) else None

    rows = []
    for prev, now in zip(arrived[1:], arrived[2:]):
        hand, hand_prev = before("H", now), before("H", prev)
        if hand is None or hand_prev is None:
            continue  # a token the trace does not cover (before its first event): not split
        posted, started = before("P", hand), after("S", hand_prev)
        if posted is None or started is None:
            continue
        rows.append({"gap": now - prev, "wake": started - hand_prev, "step": posted - started, "hand": hand - posted,
                     "client": (now - hand) - (prev - hand_prev)})
    return [{k: round(v * 1e3, 2) for k, v in r.items()} for r in rows]


async def main(rounds: int, tokens: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        site, trace = Path(tmp) / "site", Path(tmp) / "trace.txt"
        site.mkdir()
        (site / "sitecustomize.py").write_text(TRACER)
        saved = os.environ.get("PYTHONPATH")
        os.environ.update(PYTHONPATH=os.pathsep.join([str(site), saved or ""]), STREAM_GAP_TRACE=str(trace))
        try:
            server = await ServerProcess.start(flags, Path(tmp) / "server.log")
        finally:  # only the server is traced: the Tokenize client started later is not
            del os.environ["STREAM_GAP_TRACE"]
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        phases = []
        try:
            async with open_channel(server.target) as channel:
                stub = pb_grpc.RuntimeServiceStub(channel)
                await _stream(stub, 16)  # warm-up
                for _ in range(rounds):
                    for arm in ("alone", "beside"):
                        arrived = await (_stream(stub, tokens) if arm == "alone" else _beside(stub, server.target, tokens))
                        phases.append((arm, arrived, round(os.getloadavg()[0], 2)))
        finally:
            await server.stop()
        events: dict[str, list[float]] = {"S": [], "P": [], "H": []}
        for line in trace.read_text().splitlines():
            kind, t = line.split()
            events[kind].append(float(t))
    for times in events.values():
        times.sort()
    out = []
    for arm, arrived, load in phases:
        rows = split(arrived, events)
        out.append({"arm": arm, "load_1m": load, "gap_ms": {"median": statistics.median(r["gap"] for r in rows),
                                                             "worst": max(r["gap"] for r in rows)},
                    "component_medians_ms": {k: statistics.median(r[k] for r in rows)
                                             for k in ("wake", "step", "hand", "client")},
                    "worst_gaps_ms": sorted(rows, key=lambda r: -r["gap"])[:5]})
    return {"serve_flags": flags, "tokens": tokens, "phases": out}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True, help="JSON path")
    parser.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                        help="extra `serve` flag (repeatable; --serve-flag=--x=1 for a value starting with -)")
    args = parser.parse_args()
    data = asyncio.run(main(args.rounds, args.tokens, args.serve_flag))
    data.update(date=time.strftime("%Y-%m-%d"), host="vm", cpus=os.cpu_count(),
                command=" ".join(["scripts/profile_stream_gaps.py", *sys.argv[1:]]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    for p in data["phases"]:
        print(json.dumps({k: p[k] for k in ("arm", "load_1m", "gap_ms", "component_medians_ms")}))
        print("   worst:", [(r["gap"], r["step"], r["hand"], r["client"]) for r in p["worst_gaps_ms"][:3]])
