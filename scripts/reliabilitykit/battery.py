"""The whole battery in one run: its two sizes, the servers it starts, the sections, the JSON.

The sections that need no process control (bad input, cancels, fuzz, traffic, hostile
restores, text stall) run against one spawned `serve`; the traffic and hostile-restore
sections read that process's RSS, and the shutdown section ends it with SIGTERM. The
security section starts two more servers (TLS with bearer tokens; mTLS) and checks that a
public bind without them is refused. The rogue-worker section starts a `--spawn-shards`
server and a `--shards` control of its own; the full-disk section starts its own (twice) on
a tmpfs. A section that raises is a failed section, never a lost run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import platform
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Sequence

from reliabilitykit.bad_input import run_bad_input
from reliabilitykit.cancels import CancelPlan, run_cancels
from reliabilitykit.full_disk import DiskPlan, run_full_disk
from reliabilitykit.fuzz import FuzzPlan, run_fuzz
from reliabilitykit.hostile_restores import MIB, RestorePlan, run_hostile_restores
from reliabilitykit.report import SectionReport, battery_json
from reliabilitykit.rogue_worker import run_rogue_worker
from reliabilitykit.security_checks import SecuredTargets, run_security
from reliabilitykit.server_process import ServerProcess, exposure_refused
from reliabilitykit.shutdown import run_shutdown
from reliabilitykit.text_stall import StallPlan, run_text_stall
from reliabilitykit.traffic import TrafficPlan, run_traffic
from inference_engine.security.credentials import open_channel

SECTIONS = ("bad_input", "cancels", "fuzz", "traffic", "hostile_restores", "text_stall", "shutdown", "security",
            "rogue_worker", "full_disk")


@dataclass(frozen=True)
class BatteryPlan:
    """How big a run is."""

    name: str  # "quick" (the bounded form the tests run) or "full"
    cancels: CancelPlan
    traffic: TrafficPlan
    fuzz: FuzzPlan
    grace_s: float  # --grace of the spawned server (the shutdown section outlives it)
    max_sessions: int  # --max-sessions of the spawned server
    restores: RestorePlan = RestorePlan()  # hostile uploads (issue 28)
    stall: StallPlan = StallPlan()  # a stream beside maximal Tokenize calls (issue 28)
    disk: DiskPlan = DiskPlan()  # persistence on a disk that fills (issue 28)


QUICK = BatteryPlan("quick", CancelPlan(trials=24, clients=3), TrafficPlan(clients=4, calls=6),
                    FuzzPlan(examples=20), grace_s=2.0, max_sessions=16,
                    restores=RestorePlan(upload_bytes=64 * MIB), stall=StallPlan(new_tokens=128),
                    disk=DiskPlan(sessions=3, appends=2))
FULL = BatteryPlan("full", CancelPlan(trials=100, clients=4), TrafficPlan(clients=8, calls=12),
                   FuzzPlan(examples=150), grace_s=3.0, max_sessions=16, stall=StallPlan(rounds=3))


@dataclass(frozen=True)
class PkiFiles:
    """Certificates for the security section (PEM files)."""

    ca: Path  # signed the server's and both clients' certificates
    other_ca: Path  # signed nothing here
    server: tuple[Path, Path]  # certificate and key for 127.0.0.1 / localhost
    client_a: tuple[Path, Path]
    client_b: tuple[Path, Path]


async def guarded(name: str, section: Awaitable[SectionReport]) -> SectionReport:
    """Run a section; one that raises is reported as a failed section."""
    try:
        return await section
    except Exception as exc:  # noqa: BLE001 - the run goes on with the other sections
        report = SectionReport(name)
        report.check(False, "the section ran to its end", f"{type(exc).__name__}: {exc}")
        return report.finish()


def serve_flags(plan: BatteryPlan, model: str | None, extra: Sequence[str] = ()) -> list[str]:
    """The `serve` flags of the battery's server."""
    return [*(["--model", model] if model else []), "--max-sessions", str(plan.max_sessions),
            "--grace", str(plan.grace_s), *extra]


async def run_on_server(server: ServerProcess, plan: BatteryPlan, sections: Sequence[str]) -> list[SectionReport]:
    """The sections that drive one plain server; `shutdown` (last) ends it."""
    out = []
    channel = open_channel(server.target)
    try:
        if "bad_input" in sections:
            out.append(await guarded("bad_input", run_bad_input(channel)))
        if "cancels" in sections:
            out.append(await guarded("cancels", run_cancels(channel, plan.cancels)))
        if "fuzz" in sections:
            out.append(await guarded("fuzz", asyncio.to_thread(run_fuzz, server.target, plan.fuzz)))
        if "traffic" in sections:
            out.append(await guarded("traffic", run_traffic(channel, server.rss, plan.traffic)))
        if "hostile_restores" in sections:
            out.append(await guarded("hostile_restores", run_hostile_restores(channel, server.rss, plan.restores)))
        if "text_stall" in sections:
            out.append(await guarded("text_stall", run_text_stall(channel, server.target, plan.stall)))
    finally:
        await channel.close()
    if "shutdown" in sections:
        out.append(await guarded("shutdown", run_shutdown(server)))
    return out


async def run_security_spawned(flags: Sequence[str], pki: PkiFiles, workdir: Path) -> SectionReport:
    """Start a TLS + tokens server and an mTLS server, run the security checks, stop them (exit 0)."""
    token_a, token_b = secrets.token_hex(16), secrets.token_hex(16)
    tokens = workdir / "reliability-tokens.txt"
    tokens.write_text(f"{token_a}\n{token_b}\n")
    tokens.chmod(0o600)
    tls = ["--tls-cert", str(pki.server[0]), "--tls-key", str(pki.server[1])]
    tls_tokens, mtls = await asyncio.gather(
        ServerProcess.start([*flags, *tls, "--auth-token-file", str(tokens)], workdir / "server-tls-tokens.log"),
        ServerProcess.start([*flags, *tls, "--tls-client-ca", str(pki.ca)], workdir / "server-mtls.log"))
    try:
        report = await run_security(SecuredTargets(tls_tokens.target, mtls.target, pki.ca, pki.other_ca, token_a, token_b,
                                                   pki.client_a, pki.client_b))
    finally:
        statuses = await asyncio.gather(tls_tokens.stop(), mtls.stop())
    report.check(statuses == [0, 0], "the secured servers exit 0 on SIGTERM", str(statuses))
    ok, detail = await asyncio.to_thread(exposure_refused)
    report.check(ok, "serve --host 0.0.0.0 without TLS and authentication is refused", detail)
    return report.finish()


async def run_battery(plan: BatteryPlan, model: str | None, workdir: Path, sections: Sequence[str] = SECTIONS,
                      extra_flags: Sequence[str] = (), pki: PkiFiles | None = None) -> dict:
    """Start the server(s), run `sections`, and return the run as JSON-ready data.

    Args:
        plan: QUICK or FULL (or your own).
        model: `serve --model` (None = the packaged default).
        workdir: where server logs and the token file go.
        sections: which of SECTIONS to run.
        extra_flags: more `serve` flags for every server started.
        pki: certificates for the security section (skipped without them).
    """
    started, load_at_start = time.monotonic(), os.getloadavg()  # other work on the machine, for reading timings
    workdir.mkdir(parents=True, exist_ok=True)
    flags = serve_flags(plan, model, extra_flags)
    reports: list[SectionReport] = []
    server_info: dict = {"flags": flags}
    if set(sections) - {"security", "rogue_worker", "full_disk"}:
        snapshots = ["--snapshot-dir", str(workdir / "snapshots")]  # SnapshotSession to_dir, RestoreSession file
        server = await ServerProcess.start([*flags, *snapshots], workdir / "server.log")
        server_info.update(target=server.target, pid=server.pid, rss_mib_at_start=round(server.rss() / (1 << 20), 1))
        try:
            reports += await run_on_server(server, plan, sections)
        finally:
            server_info["exit_status"] = await server.stop()
    if "security" in sections and pki is not None:
        reports.append(await guarded("security", run_security_spawned(flags, pki, workdir)))
    if "rogue_worker" in sections:
        reports.append(await guarded("rogue_worker", run_rogue_worker(flags, model, workdir)))
    if "full_disk" in sections:
        reports.append(await guarded("full_disk", run_full_disk(flags, workdir, plan.disk)))
    meta = {
        "battery": "issue 15 reliability", "plan": dataclasses.asdict(plan), "model": model or "packaged default",
        "server": server_info, "host": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
        "started_unix": time.time() - (time.monotonic() - started), "seconds": round(time.monotonic() - started, 1),
        "load_average": {"start": [round(x, 2) for x in load_at_start], "end": [round(x, 2) for x in os.getloadavg()]},
    }
    return battery_json(reports, meta)
