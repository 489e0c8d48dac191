"""`--persist-sessions` on a disk that fills up (issue 28, defect 2): no session comes back stale.

The probe's repro: sessions on a small tmpfs (mounted here; the battery runs as root), calls
acknowledged while the disk is full, SIGTERM, a restart. Every session the restarted server
has must hold every acknowledged call (the probe's came back with history 0); the others must
be gone, each with its log line. Meanwhile /metrics counts the failed writes and the health
service `inference_engine.persistence` reports NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reliabilitykit.report import SectionReport
from reliabilitykit.server_process import ServerProcess
from inference_engine.security.credentials import open_channel
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

PERSISTENCE = "inference_engine.persistence"  # server/health.py's service name
CHUNK = (5, 17, 33, 2, 250, 9, 9, 120, 64, 3, 11, 13)


@dataclass(frozen=True)
class DiskPlan:
    """The size of the scenario."""

    sessions: int = 6
    appends: int = 3  # calls written before the disk fills
    disk_mib: int = 16  # the tmpfs (a session at window 16 is ~1 MB with the packaged model)
    patience_s: float = 60.0  # how long background writes and health changes may take


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill(disk: Path) -> None:
    with open(disk / "filler", "ab") as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(1 << 16))
            f.flush()
            os.fsync(f.fileno())


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def _until(predicate, patience_s: float) -> bool:  # noqa: ANN001 - an async predicate
    deadline = asyncio.get_running_loop().time() + patience_s
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.2)
    return False


async def run_full_disk(flags: Sequence[str], workdir: Path, plan: DiskPlan) -> SectionReport:
    """Fill the persistence disk under acknowledged calls, restart, and count stale sessions (must be 0)."""
    report = SectionReport("full_disk")
    disk = workdir / "full-disk"
    disk.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={plan.disk_mib}m,mode=0700", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if not report.check(mounted.returncode == 0, "a tmpfs can be mounted (needs root)", mounted.stderr.strip()):
        return report.finish()
    try:
        await _scenario(report, flags, workdir, disk, plan)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    return report.finish()


async def _scenario(report: SectionReport, flags: Sequence[str], workdir: Path, disk: Path, plan: DiskPlan) -> None:
    metrics_port = _free_port()
    served = [*flags, "--persist-sessions", str(disk / "sessions"), "--persist-interval", "0",
              "--metrics-port", str(metrics_port)]
    server = await ServerProcess.start(served, workdir / "server-full-disk.log")
    expected: dict[str, int] = {}
    try:
        channel = open_channel(server.target)
        stub, health = pb_grpc.RuntimeServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        for _ in range(plan.sessions):
            sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=4, window_tokens=16))).session_id
            for _ in range(plan.appends):
                expected[sid] = (await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=CHUNK))
                                 ).history_length
        files = disk / "sessions"
        written = await _until(lambda: _true(len(list(files.glob("session-*.iesnap"))) == plan.sessions),
                               plan.patience_s)
        report.check(written, "every session is written before the disk fills")
        await asyncio.sleep(1.0)  # the last writes' renames
        failures_before = _metric(metrics_port, "inference_engine_persist_failures_total")
        _fill(disk)
        probe = disk / "probe"
        try:
            probe.write_bytes(bytes(1 << 16))
            full = False
        except OSError as exc:
            full = exc.errno == errno.ENOSPC
        probe.unlink(missing_ok=True)
        report.check(full, "the disk is full")
        for sid in expected:  # acknowledged, and cannot be written
            expected[sid] = (await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=CHUNK))
                             ).history_length

        async def not_durable() -> bool:
            status = (await health.Check(health_pb2.HealthCheckRequest(service=PERSISTENCE))).status
            return status == health_pb2.HealthCheckResponse.NOT_SERVING

        report.check(await _until(not_durable, plan.patience_s),
                     "health service inference_engine.persistence reports NOT_SERVING")
        def failed() -> float:
            return _metric(metrics_port, "inference_engine_persist_failures_total") - failures_before

        counted = await _until(lambda: _true(failed() >= plan.sessions), plan.patience_s)
        report.numbers["persist_failures_counted"] = failed()
        report.check(counted, "/metrics counts every failed write", str(failed()))
        await channel.close()
    finally:
        report.numbers["first_exit_status"] = await server.stop()
    (disk / "filler").unlink(missing_ok=True)  # the operator makes room, then restarts
    server = await ServerProcess.start(served, workdir / "server-full-disk-restart.log")
    try:
        channel = open_channel(server.target)
        stub = pb_grpc.RuntimeServiceStub(channel)
        restored, stale, dropped = 0, 0, 0
        for sid, history in expected.items():
            try:
                info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
            except grpc.aio.AioRpcError as err:
                dropped += err.code() == grpc.StatusCode.NOT_FOUND
                continue
            restored += info.history_length == history
            stale += info.history_length != history
        await channel.close()
    finally:
        report.numbers["second_exit_status"] = await server.stop()
    log = (workdir / "server-full-disk-restart.log").read_text(errors="replace")
    logged = log.count("not restored: its latest state could not be written")
    report.numbers.update(sessions=len(expected), restored_current=restored, restored_stale=stale, dropped=dropped,
                          drops_logged=logged)
    report.check(stale == 0, "no session comes back stale after a full disk", f"{stale} of {len(expected)}")
    report.check(restored + dropped == len(expected) and logged == dropped,
                 "every session is current or dropped with a log line", f"{restored} current, {dropped} dropped, "
                 f"{logged} logged")


async def _true(value: bool) -> bool:
    return value
