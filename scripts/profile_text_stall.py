#!/usr/bin/env python3
"""Profile of issue 28's text stall: where a stream's inter-token gaps go beside maximal Tokenize calls.

    .venv/bin/python scripts/profile_text_stall.py --rounds 3 --out results/reliability/profile-text-stall.json
    .venv/bin/python scripts/profile_text_stall.py --serve-flag=--text-process-chars=0 --out ...  # all in-process

Against a real `serve` process: a greedy stream alone, then beside another process's back-to-back
65,536-character Tokenize calls, alternating --rounds times. For each phase the gaps' median,
p90, p99 and worst, and every busy server thread's CPU time, run-queue wait (schedstat: ready
but given no CPU) and niceness. A thread holding the GIL would show as the engine threads'
wall time spent neither on a CPU nor waiting for one; a CPU competitor shows as run-queue
wait. Then, in this process, how long each stage of one maximal Tokenize keeps a 1 ms ticker
thread from the GIL (the bindings' `encode`, the `encode_batch` the server uses, the ids
list, the response message).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inference_engine.security.credentials import open_channel  # noqa: E402
from inference_engine.v1 import runtime_pb2 as pb  # noqa: E402
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc  # noqa: E402
from reliabilitykit import text_stall  # noqa: E402
from reliabilitykit.server_process import ServerProcess  # noqa: E402

CHARS = 65536  # serve's default --max-text-chars


def sched(pid: int) -> dict[str, tuple[int, int, int]]:
    """Each thread's (CPU ns, run-queue wait ns, nice)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpu, wait, _ = (int(x) for x in Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            out[tid] = (cpu, wait, int(stat[stat.rindex(")") + 2:].split()[16]))
        except FileNotFoundError:  # the thread ended
            pass
    return out


def children_cpu_ns(pid: int) -> dict[int, int]:
    """CPU ns of each child process of `pid` (the tokenizer processes), all their threads."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                    out[int(entry)] = sum(int(Path(f"/proc/{entry}/task/{t}/schedstat").read_text().split()[0])
                                          for t in os.listdir(f"/proc/{entry}/task"))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


async def phase(stub: pb_grpc.RuntimeServiceStub, server: ServerProcess, beside: bool) -> dict:
    other = None
    if beside:
        other = await asyncio.create_subprocess_exec(
            sys.executable, "-m", text_stall.__name__, server.target, str(CHARS), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": f"{REPO / 'scripts'}{os.pathsep}{REPO}"})
        assert other.stdout is not None and other.stdin is not None
        await other.stdout.readline()
    a, ca, started = sched(server.pid), children_cpu_ns(server.pid), time.perf_counter()
    gaps = [g * 1e3 for g in await text_stall._gaps(stub, 256)]
    wall, b, cb = time.perf_counter() - started, sched(server.pid), children_cpu_ns(server.pid)
    children_cpu = sum(cpu - ca.get(child, 0) for child, cpu in cb.items())
    calls = 0
    if other is not None:
        assert other.stdin is not None
        other.stdin.close()
        out, _ = await other.communicate()
        calls = int(out.split()[-1])
    threads, server_cpu = [], 0
    for tid, (cpu, wait, nice) in b.items():
        server_cpu += cpu - a.get(tid, (0, 0, nice))[0]
        c0, w0, _ = a.get(tid, (0, 0, nice))
        if cpu - c0 > 50e6:
            threads.append({"tid": int(tid), "nice": nice, "cpu_ms": round((cpu - c0) / 1e6),
                            "run_queue_wait_ms": round((wait - w0) / 1e6)})
    return {"beside_tokenize": beside, "tokenize_calls": calls, "wall_s": round(wall, 2),
            "load_1m": round(os.getloadavg()[0], 2), "server_cpu_ms": round(server_cpu / 1e6),
            "child_processes_cpu_ms": round(children_cpu / 1e6),
            "gap_ms": {"median": round(statistics.median(gaps), 1), "p90": _pct(gaps, 0.9), "p99": _pct(gaps, 0.99),
                       "worst": round(max(gaps), 1)},
            "threads_over_50ms_cpu": sorted(threads, key=lambda t: -t["cpu_ms"])}


def gil_stages() -> dict:
    """Worst wake-up delay of a 1 ms ticker thread during each stage of one maximal Tokenize (median of 5)."""
    from inference_engine.model.packaged import DEFAULT_MODEL, resolve_model_path
    from tokenizers import Tokenizer

    path = resolve_model_path(DEFAULT_MODEL, Path.home() / ".cache" / "inference_engine")
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    text = text_stall.largest_text(CHARS)
    gaps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    threading.Thread(target=ticker, daemon=True).start()
    out = {}

    def stage(name: str, fn):
        worst, took, result = [], [], None
        for _ in range(5):
            time.sleep(0.05)
            gaps.clear()
            t0 = time.perf_counter()
            result = fn()
            took.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.005)
            worst.append(max(gaps) * 1e3)
        out[name] = {"took_ms": round(statistics.median(took), 1), "worst_ticker_gap_ms": round(statistics.median(worst), 1)}
        return result

    stage("idle (sleep 50 ms)", lambda: time.sleep(0.05))
    stage("Tokenizer.encode (the bindings' single call)", lambda: tok.encode(text))
    (enc,) = stage("Tokenizer.encode_batch([text]) (what the server calls)", lambda: tok.encode_batch([text]))
    ids = stage("list(encoding.ids)", lambda: list(enc.ids))
    msg = stage("TokenizeResponse(tokens=ids, text=text)", lambda: pb.TokenizeResponse(tokens=ids, text=text))
    stage("TokenizeResponse.SerializeToString", msg.SerializeToString)
    stop.set()
    return out


async def main(rounds: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = await ServerProcess.start(["--max-sessions", "16", *flags], Path(tmp) / "server.log")
        channel = open_channel(server.target)
        phases = []
        try:
            stub = pb_grpc.RuntimeServiceStub(channel)
            await text_stall._gaps(stub, 16)  # warm-up
            for _ in range(rounds):
                for beside in (False, True):
                    phases.append(await phase(stub, server, beside))
        finally:
            await channel.close()
            await server.stop()
    return {"serve_flags": flags, "phases": phases, "gil_stages_in_one_process": gil_stages()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="JSON path")
    parser.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                        help="extra `serve` flag (repeatable; --serve-flag=--x=1 for a value starting with -)")
    args = parser.parse_args()
    data = asyncio.run(main(args.rounds, args.serve_flag))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    for p in data["phases"]:
        print(json.dumps({k: p[k] for k in ("beside_tokenize", "load_1m", "server_cpu_ms", "child_processes_cpu_ms",
                                                "gap_ms")}))
    print(json.dumps(data["gil_stages_in_one_process"], indent=1))
