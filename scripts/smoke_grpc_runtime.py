#!/usr/bin/env python3
"""Smoke test of RuntimeService against a running (or spawned) server.

    python scripts/smoke_grpc_runtime.py --target 127.0.0.1:50051
    python scripts/smoke_grpc_runtime.py --spawn            # serve --port 0 --max-sessions 3

Each scenario records the gRPC code it expects and the one it observed; the report is
written as JSON (default results/smoke/smoke-<UTC timestamp>.json). Exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the package is used from the checkout, not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (smokekit)

from inference_engine.v1 import runtime_pb2_grpc as pb_grpc  # noqa: E402
from smokekit.common import READY_TIMEOUT_S, ScenarioResult  # noqa: E402
from smokekit.scenarios import Smoke  # noqa: E402


# ---- server process -------------------------------------------------------------------------


async def spawn_server(log_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    """Start `serve --port 0 --max-sessions 3`; returns the process and its HOST:PORT.

    Raises:
        RuntimeError: the server exited or stayed silent before its readiness line.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:  # the child keeps its own handle
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--max-sessions", "3",
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=log,
        )
    from inference_engine.readiness import wait_ready_async

    try:
        return proc, await wait_ready_async(proc, READY_TIMEOUT_S)
    except OSError as exc:
        raise RuntimeError(f"server did not become ready ({exc}; log: {log_path})") from None


async def stop_server(proc: asyncio.subprocess.Process, timeout_s: float = 60.0) -> int | None:
    """SIGTERM the server and wait for it; returns its exit code (None if it had to be killed)."""
    if proc.returncode is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return None


# ---- entry point ----------------------------------------------------------------------------


def write_report(path: Path, target: str, started: datetime, smoke: Smoke, extra: dict[str, Any]) -> dict[str, Any]:
    passed = sum(r.passed for r in smoke.results)
    report = {
        "timestamp": started.isoformat(timespec="seconds"),
        "target": target,
        "platform": platform.platform(),
        "tokenizer": "the server's (Tokenize, chat messages)",
        **extra,
        "summary": {"total": len(smoke.results), "passed": passed, "failed": len(smoke.results) - passed},
        "scenarios": [asdict(r) for r in smoke.results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return report


async def run(args: argparse.Namespace) -> int:
    started = datetime.now(timezone.utc)
    out = Path(args.out) if args.out else REPO / "results" / "smoke" / f"smoke-{started:%Y%m%dT%H%M%SZ}.json"
    smoke = Smoke(None)  # type: ignore[arg-type]  # stub set once the channel exists
    extra: dict[str, Any] = {"spawned": args.spawn}
    proc: asyncio.subprocess.Process | None = None
    target = args.target or ""
    try:
        if args.spawn:
            log_path = out.with_suffix(".server.log")
            extra["server_log"] = str(log_path)
            holder: dict[str, Any] = {}

            async def start(data: dict[str, Any]) -> str:
                holder["proc"], holder["target"] = await spawn_server(log_path)
                data["target"] = holder["target"]
                return f"listening on {holder['target']}"

            await smoke.scenario("server_ready", "OK", start)
            proc, target = holder.get("proc"), holder.get("target", "")
        if target:
            async with grpc.aio.insecure_channel(target) as channel:
                try:
                    await asyncio.wait_for(channel.channel_ready(), 30)
                except asyncio.TimeoutError:
                    smoke.record(ScenarioResult("connect", "OK", "UNAVAILABLE", f"{target} not ready within 30 s", 30e3, False))
                else:
                    smoke.stub = pb_grpc.RuntimeServiceStub(channel)
                    try:
                        await smoke.run_all()
                    finally:
                        leftovers = await smoke.close_leftovers()
                        extra["unclosed_sessions"] = leftovers
                        if leftovers:
                            print(f"WARN could not close sessions: {leftovers}", flush=True)
    finally:
        if proc is not None:
            t0 = time.perf_counter()
            rc = await stop_server(proc)
            extra["server_exit_code"] = rc
            status = "killed" if rc is None else str(rc)  # an exit status, not a gRPC code
            ms = round((time.perf_counter() - t0) * 1e3, 1)
            smoke.record(ScenarioResult("server_exit", "0", status, f"exit status {status} after SIGTERM", ms, rc == 0))
        report = write_report(out, target, started, smoke, extra)
    s = report["summary"]
    print(f"{s['passed']} passed, {s['failed']} failed  (report: {out})", flush=True)
    return 1 if s["failed"] or not s["total"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="HOST:PORT of a running server (required unless --spawn)")
    parser.add_argument("--spawn", action="store_true", help="start `serve --port 0 --max-sessions 3` and stop it at the end")
    parser.add_argument("--out", help="JSON report path (default results/smoke/smoke-<UTC timestamp>.json)")
    args = parser.parse_args(argv)
    if bool(args.target) == args.spawn:
        parser.error("give exactly one of --target HOST:PORT and --spawn")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
