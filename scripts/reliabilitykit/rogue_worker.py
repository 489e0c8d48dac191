"""A rogue listener on a dead shard worker's port (issue 28): the route must send it nothing it can use.

`serve --spawn-shards`: a session is opened and fed; the head worker is SIGKILLed; a rogue
gRPC listener binds its port before the supervisor's restart does; an append is made while it
holds the port. The route must treat it as a dead worker (the append fails UNAVAILABLE after
`--shard-recovery-timeout`) and send it nothing: no call, no bearer token, no token id. When
the rogue leaves, the restarted worker serves the session again.

Negative control: the same against `serve --shards` to workers that only require a bearer
token over plaintext (what spawned workers were before): the rogue receives the token, so the
check that the spawned route leaked nothing could have failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import grpc

from reliabilitykit.hostile_peers import RogueListener, varint_ids
from reliabilitykit.report import SectionReport
from reliabilitykit.server_process import ServerProcess
from inference_engine.readiness import wait_ready_async
from inference_engine.security.credentials import open_channel
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

PACKAGED_LAYERS = 30  # SmolLM2-135M, the packaged default
RECOVERY_S = 3.0  # --shard-recovery-timeout of the servers here: how long the rogue holds a call
FIRST = (5, 17, 33, 2, 250, 9, 9, 120)  # fed before the kill
SECRET = (31337, 4242, 27182, 16180, 14142, 17320, 22360, 26457)  # sent while the rogue holds the port
AFTER = (7, 11, 13)  # fed once the worker is back
BACK_WITHIN_S = 300.0  # a restarted worker loads its layers (a busy machine, a cold cache)
_SERVES_AT = re.compile(r"shard worker (\d+:\d+) \(pid (\d+)\) serves at (\S+)")


@dataclass
class RogueFindings:
    """What one run of the scenario saw."""

    route: str  # "spawned (mTLS + token)" or "--shards (plaintext + token)"
    code_while_held: str = ""  # the append's status code while the rogue held the head's port
    seconds_while_held: float = 0.0  # how long that append took
    rogue_calls: int = 0  # calls that reached the rogue
    rogue_methods: list[str] = field(default_factory=list)  # their methods (distinct)
    rogue_bytes: int = 0  # metadata and request bytes it received
    token_leaked: bool = False  # the route's bearer token was among them
    ids_leaked: bool = False  # the held append's token ids were among them
    authorization_seen: bool = False  # any `authorization` metadata reached it
    recovered: bool = False  # an append succeeded once the rogue left and the worker was back
    history_after: int = 0  # the session's history length then


def layer_ranges(model: str | None) -> str:
    """Two layer ranges covering `model` (an mlx-lm folder's config, else the packaged model)."""
    config = Path(model) / "config.json" if model else None
    layers = json.loads(config.read_text())["num_hidden_layers"] if config and config.is_file() else PACKAGED_LAYERS
    half = layers // 2
    return f"0:{half},{half}:{layers}"


def _token_of(pid: int) -> bytes:
    """The bearer token a spawned worker requires (read as the battery's user may, from its --auth-token-file)."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    path = args[args.index(b"--auth-token-file") + 1].decode()
    return Path(path).read_text().strip().encode()


async def _gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.01)


async def probe(target: str, head_port: int, token: bytes, kill_head: Callable[[], Awaitable[None]],
                restart_head: Callable[[], Awaitable[None]], route: str) -> RogueFindings:
    """Feed a session, kill the head, hold its port with a rogue during an append, let the worker back.

    Args:
        target: the server (plaintext, no token: a loopback test server).
        head_port: the head worker's port.
        token: the bearer token the route presents to its workers (what must not leak).
        kill_head: kills the head worker and returns once it is gone.
        restart_head: starts it again at its port (the supervisor does that itself: a no-op then).
        route: how the route reaches its workers (for the findings).
    """
    found = RogueFindings(route)
    rogue = RogueListener()
    async with open_channel(target) as channel:
        stub = pb_grpc.RuntimeServiceStub(channel)
        sid = (await stub.CreateSession(pb.CreateSessionRequest(), timeout=120)).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=FIRST), timeout=120)
        await kill_head()
        await rogue.start(head_port)
        started = time.monotonic()
        try:
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=SECRET), timeout=120)
            found.code_while_held = "OK"
        except grpc.aio.AioRpcError as exc:
            found.code_while_held = exc.code().name
        found.seconds_while_held = round(time.monotonic() - started, 2)
        await rogue.stop()
        found.rogue_calls, found.rogue_methods = rogue.calls, sorted(set(rogue.methods))
        found.rogue_bytes = len(rogue.received)
        found.token_leaked, found.ids_leaked = rogue.holds(token), rogue.holds(varint_ids(list(SECRET)))
        found.authorization_seen = any(key == "authorization" for key, _ in rogue.metadata)
        await restart_head()
        deadline = time.monotonic() + BACK_WITHIN_S
        while time.monotonic() < deadline and not found.recovered:
            try:
                reply = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=AFTER), timeout=120)
                found.recovered, found.history_after = True, reply.history_length
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.5)
    return found


async def run_spawned(flags: Sequence[str], ranges: str, workdir: Path) -> RogueFindings:
    """The scenario against `serve --spawn-shards RANGES` (the supervisor restarts the head itself)."""
    log_path = workdir / "server-spawned-shards.log"
    server = await ServerProcess.start([*flags, "--spawn-shards", ranges, "--shard-recovery-timeout", str(RECOVERY_S)],
                                       log_path)
    try:
        head = next(m for m in _SERVES_AT.finditer(log_path.read_text()) if m.group(1) == ranges.split(",")[0])
        pid, port = int(head.group(2)), int(head.group(3).rsplit(":", 1)[1])

        async def kill_head() -> None:
            os.kill(pid, signal.SIGKILL)
            await _gone(pid)

        async def supervisor_restarts() -> None:
            return None

        return await probe(server.target, port, _token_of(pid), kill_head, supervisor_restarts,
                           "spawned (mTLS + token)")
    finally:
        await server.stop()


async def _worker(layers: str, model: str | None, port: int, token_file: Path) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "inference_engine", "shard-worker", "--layers", layers, "--port", str(port),
        *(["--model", model] if model else []), "--auth-token-file", str(token_file),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL)
    address = await wait_ready_async(proc)
    return proc, int(address.rsplit(":", 1)[1])


async def run_plaintext_control(flags: Sequence[str], model: str | None, ranges: str, workdir: Path) -> RogueFindings:
    """The scenario against `serve --shards` to workers requiring a token over plaintext (the old spawned route)."""
    token = secrets.token_hex(32)
    token_file = workdir / "shard-token.txt"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    workers = [await _worker(layers, model, 0, token_file) for layers in ranges.split(",")]
    server = None
    try:
        addresses = ",".join(f"127.0.0.1:{port}" for _, port in workers)
        server = await ServerProcess.start([*flags, "--shards", addresses, "--shard-token-file", str(token_file),
                                            "--shard-recovery-timeout", str(RECOVERY_S)],
                                           workdir / "server-plaintext-shards.log")
        head_port = workers[0][1]

        async def kill_head() -> None:
            workers[0][0].kill()
            await workers[0][0].wait()

        async def restart_head() -> None:
            workers[0] = await _worker(ranges.split(",")[0], model, head_port, token_file)

        return await probe(server.target, head_port, token.encode(), kill_head, restart_head,
                           "--shards (plaintext + token)")
    finally:
        if server is not None:
            await server.stop()
        for proc, _ in workers:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


def judge(report: SectionReport, spawned: RogueFindings, control: RogueFindings | None) -> SectionReport:
    """The section's checks over the findings (a control is optional: None skips its checks)."""
    report.numbers["spawned"] = asdict(spawned)
    report.check(spawned.code_while_held == "UNAVAILABLE",
                 "spawned route: an append while a rogue holds the head's port fails UNAVAILABLE", spawned.code_while_held)
    report.check(spawned.rogue_calls == 0, "spawned route: no call reaches the rogue listener",
                 f"{spawned.rogue_calls} calls: {spawned.rogue_methods}")
    report.check(not spawned.token_leaked and not spawned.authorization_seen,
                 "spawned route: the rogue receives no bearer token")
    report.check(not spawned.ids_leaked, "spawned route: the rogue receives no prompt token id")
    report.check(spawned.recovered and spawned.history_after >= len(FIRST) + len(AFTER),
                 "spawned route: the restarted worker serves the session once the rogue leaves",
                 f"recovered={spawned.recovered} history={spawned.history_after}")
    if control is not None:
        report.numbers["plaintext_control"] = asdict(control)
        report.check(control.token_leaked and control.rogue_calls > 0,
                     "negative control: over plaintext (--shards with a token) the rogue does receive the token",
                     f"{control.rogue_calls} calls, token_leaked={control.token_leaked}")
    return report


async def run_rogue_worker(flags: Sequence[str], model: str | None, workdir: Path, control: bool = True
                           ) -> SectionReport:
    """The section: the spawned route against a rogue listener, and (with `control`) the plaintext route."""
    report = SectionReport("rogue_worker")
    ranges = layer_ranges(model)
    spawned = await run_spawned(flags, ranges, workdir)
    plain = await run_plaintext_control(flags, model, ranges, workdir) if control else None
    return judge(report, spawned, plain).finish()
