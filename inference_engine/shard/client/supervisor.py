"""WorkerSupervisor: the server's own shard workers (`serve --spawn-shards 0:10,10:20,20:30`).

Each layer range runs as a `shard-worker` subprocess. The first start picks a free port;
a worker that dies is restarted at the same address, so the route (and its clients'
channels) stays the same and sessions recover by replay (see route_backend.py). A worker that
hangs (it misses a step deadline: `stop_silent`) counts as failed: it is killed, so it restarts too.

The workers listen on loopback, where any local process could reach them, or bind a dead
worker's port before its restart does. So the route and the workers authenticate each other
before anything is sent: each supervisor makes its own CA (`security/spawn_pki.py`), the
workers serve mTLS with its worker certificate and require its route certificate, and the
route trusts only that CA; the route also presents a random bearer token the workers require.
Certificates, keys and token live in a private folder (mode 0700, files 0600), removed at stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from inference_engine.launch import module_command
from inference_engine.readiness import wait_ready_async
from inference_engine.security.settings import ClientSecurity
from inference_engine.security.spawn_pki import SpawnPki, make_spawn_pki
from inference_engine.shard.protocol.types import LayerRange

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 300.0  # loading a layer range (and probing) can take a while on a busy machine
RESTART_PAUSE_S = 0.5  # between failed restart attempts (e.g. the port is not free yet)
CREDENTIALS_PREFIX = "inference-engine-shard-"  # the credentials folder's name, in the temporary folder
OWNER_FILE = "owner.pid"  # in it: the server's pid (a folder whose server died is removed at the next start)


@dataclass(frozen=True)
class WorkerFlags:
    """What every spawned worker is started with (mirrors the server's own limits)."""

    host: str  # address the workers bind (the server uses loopback: they are its own children)
    model: str  # packaged model name, mlx-lm folder or .gguf file (the server's)
    block: int  # rows per chunk: the server's probed tile (same machine, same BLAS)
    max_sessions: int  # route sessions per worker
    max_sink: int  # largest sink
    max_window: int  # largest window
    weights: str = "q4_1"  # --weights: what the server itself serves (q4_1 or fp32)


class WorkerSupervisor:
    """Spawns one worker per layer range and restarts any that exits, at the same address."""

    def __init__(self, layer_ranges: tuple[str, ...], flags: WorkerFlags):
        self.layer_ranges = layer_ranges
        self.flags = flags
        self.addresses: list[str] = []  # host:port per range, once started
        self.procs: list[asyncio.subprocess.Process | None] = [None] * len(layer_ranges)
        self._started = [0.0] * len(layer_ranges)  # when each worker's process was started (monotonic)
        self.restarts = 0  # workers restarted since start
        self._watchers: list[asyncio.Task] = []
        self._stopping = False
        self._token = secrets.token_hex(32)  # what the workers require and the route presents
        self.credentials_dir: Path | None = None  # private folder of the files below (made at start)
        self.token_file: Path | None = None  # the workers' --auth-token-file
        self.pki: SpawnPki | None = None  # the workers' certificate, the route's, and the CA both trust

    @property
    def client_security(self) -> ClientSecurity:
        """What the route presents to these workers: its certificate and their bearer token; it trusts only
        this supervisor's CA (call after `start`)."""
        assert self.pki is not None, "the credentials are made at start"
        return ClientSecurity(ca_file=self.pki.ca, cert_file=self.pki.route_cert, key_file=self.pki.route_key,
                              token=self._token)

    def _write_credentials(self) -> None:
        remove_orphaned_credentials()
        self.credentials_dir = Path(tempfile.mkdtemp(prefix=CREDENTIALS_PREFIX))  # mode 0700
        self.token_file = self.credentials_dir / "token.txt"
        for path, text in ((self.credentials_dir / OWNER_FILE, str(os.getpid())), (self.token_file, self._token)):
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(text + "\n")
        self.pki = make_spawn_pki(self.credentials_dir, self.flags.host)

    async def start(self) -> list[str]:
        """Start every worker (in parallel) and supervise them; returns their addresses, head first.

        If a worker fails to start, or the start is cancelled, every worker started is stopped and
        the credentials folder removed before this returns.

        Raises:
            OSError: a worker did not become ready (its stderr is in the server's log), or the
                credentials cannot be written.
        """
        try:
            self._write_credentials()
        except BaseException:
            await self.stop()
            raise
        spawns = [asyncio.ensure_future(self._spawn(i, 0)) for i in range(len(self.layer_ranges))]
        try:
            ports = await asyncio.gather(*spawns)
        except BaseException:  # the others are still loading: end them too (a cancelled gather already did)
            for spawn in spawns:
                spawn.cancel()
            await asyncio.wait(spawns)
            for spawn in spawns:  # retrieved: the first failure is the one reported
                _ = spawn.cancelled() or spawn.exception()
            await self.stop()
            raise
        self.addresses = [f"{self.flags.host}:{p}" for p in ports]
        self._watchers = [asyncio.get_running_loop().create_task(self._watch(i)) for i in range(len(ports))]
        return self.addresses

    async def _spawn(self, i: int, port: int) -> int:
        """Start worker `i` on `port` (0 = any) and wait for its readiness line; returns its port."""
        f = self.flags
        # Shielded: a start cancelled while the process is being created still learns of it (and stops it).
        command, env = module_command(  # this server's copy of the package, never the current folder's
            "shard-worker", "--layers", self.layer_ranges[i],
            "--host", f.host, "--port", str(port), "--model", f.model, "--weights", f.weights, "--block", str(f.block),
            "--max-sessions", str(f.max_sessions),
            "--max-sink", str(f.max_sink), "--max-window", str(f.max_window),
            "--parent-pid", str(os.getpid()),  # a server killed outright does not leave its workers behind
            "--auth-token-file", str(self.token_file),  # the route's token, over mTLS with the route's certificate
            "--tls-cert", str(self.pki.worker_cert), "--tls-key", str(self.pki.worker_key),
            "--tls-client-ca", str(self.pki.ca),
        )
        creating = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *command, env=env, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        ))
        try:
            proc = await asyncio.shield(creating)
        except asyncio.CancelledError:
            await asyncio.wait((creating,))
            if not creating.cancelled() and creating.exception() is None:
                self.procs[i] = creating.result()
            raise
        self.procs[i], self._started[i] = proc, time.monotonic()
        try:
            address = await wait_ready_async(proc, READY_TIMEOUT_S)
        except OSError as exc:
            raise OSError(f"shard worker {self.layer_ranges[i]} did not start ({exc})") from exc
        log.info("shard worker %s (pid %d) serves at %s", self.layer_ranges[i], proc.pid, address)
        return int(address.rsplit(":", 1)[1])

    async def _watch(self, i: int) -> None:
        port = int(self.addresses[i].rsplit(":", 1)[1])
        while True:
            proc = self.procs[i]
            status = await proc.wait()
            if self._stopping:
                return
            log.warning("shard worker %s (pid %d) exited with status %s; restarting it at %s",
                        self.layer_ranges[i], proc.pid, status, self.addresses[i])
            while not self._stopping:
                try:
                    await self._spawn(i, port)
                    self.restarts += 1
                    break
                except OSError as exc:
                    log.error("restarting shard worker %s failed: %s; retrying", self.layer_ranges[i], exc)
                    await asyncio.sleep(RESTART_PAUSE_S)

    def stop_silent(self, address: str, deadline_s: float) -> None:
        """Kill the worker at `address`, which did not answer within its deadline; its watcher restarts it.

        Args:
            deadline_s: the deadline it missed: a worker started since then is not the one that missed it.
        """
        if self._stopping or address not in self.addresses:
            return
        i = self.addresses.index(address)
        proc = self.procs[i]
        if proc is None or proc.returncode is not None or time.monotonic() - self._started[i] < deadline_s:
            return
        log.warning("shard worker %s (pid %d) at %s did not answer within its %g s deadline; killing it so it is "
                    "restarted", self.layer_ranges[i], proc.pid, address, deadline_s)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop supervising and end every worker (SIGTERM, then SIGKILL after `grace_s`)."""
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        for proc in self.procs:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in self.procs:
            if proc is None:
                continue
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self.credentials_dir is not None:
            shutil.rmtree(self.credentials_dir, ignore_errors=True)


def remove_orphaned_credentials(folder: Path | None = None) -> list[Path]:
    """Remove the credentials folders of this user's supervisors that died without stopping (a SIGKILLed
    server leaves its token and keys behind); returns them. A folder whose owner still runs is kept.

    Args:
        folder: where they are (default: the temporary folder).
    """
    removed = []
    for path in Path(folder or tempfile.gettempdir()).glob(f"{CREDENTIALS_PREFIX}*"):
        try:
            if path.stat().st_uid != os.getuid():
                continue
            pid = int((path / OWNER_FILE).read_text())
        except (OSError, ValueError):  # another user's, not one of ours, or one being made right now
            continue
        try:
            os.kill(pid, 0)
            continue  # its server still runs (or the pid was reused: kept, to be safe)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed the shard credentials of a server that died without stopping (pid %d)", pid)
        removed.append(path)
    return removed


def check_layer_ranges(ranges: Sequence[str], num_layers: int) -> None:
    """`--spawn-shards` ranges must cover the model's layers in order, without gaps or overlaps.

    Checked before any worker is spawned: a worker finds out only after seconds of loading.

    Raises:
        ValueError: the first range that does not fit, what was expected and a range split that would.
    """
    n = max(1, min(len(ranges), num_layers))
    cuts = [round(k * num_layers / n) for k in range(n + 1)]
    example = ",".join(f"{a}:{b}" for a, b in zip(cuts, cuts[1:]))
    start, problem = 0, ""
    for text in ranges:
        try:
            r = LayerRange.parse(text)
        except ValueError as exc:
            problem = str(exc)
            break
        if r.start != start:
            gap = f"layers {start}:{r.start} are in no range" if r.start > start else "it overlaps the range before"
            problem = f"layer range {r} starts at layer {r.start}, not {start} ({gap})"
            break
        if r.end > num_layers:
            problem = f"layer range {r} ends past the model's {num_layers} layers"
            break
        start = r.end
    if not problem and start != num_layers:
        problem = f"the ranges end at layer {start}; the model has {num_layers} layers"
    if problem:
        raise ValueError(f"--spawn-shards {','.join(ranges)}: {problem}: the ranges must cover the model's "
                         f"{num_layers} layers in order without gaps or overlaps, e.g. {example}")
