"""WorkerSupervisor's failure paths with real worker processes: no start, failed restarts, stop."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dataclasses import replace

import grpc
import pytest

from inference_engine.security.credentials import open_channel
from inference_engine.security.settings import ClientSecurity
from inference_engine.server.server import connect_shards
from inference_engine.shard.client import supervisor as supervisor_module
from inference_engine.shard.client.supervisor import WorkerFlags, WorkerSupervisor, check_layer_ranges
from inference_engine.v1 import shard_runtime_pb2 as spb
from inference_engine.v1.shard_runtime_pb2_grpc import ShardRuntimeStub
from tests.conftest import make_config

pytestmark = pytest.mark.real_model


def _flags(model: str) -> WorkerFlags:
    return WorkerFlags(host="127.0.0.1", model=model, block=4, max_sessions=1, max_sink=4,
                       max_window=16)


async def test_a_worker_that_cannot_start_fails_the_start(tmp_path):
    sup = WorkerSupervisor(("0:1",), _flags(str(tmp_path / "no-such-model")))
    with pytest.raises(OSError, match=r"shard worker 0:1 did not start \(exit status \d+\)"):
        await sup.start()
    await sup.stop()


async def test_restart_retries_until_the_port_is_free_again(real_model_path):
    sup = WorkerSupervisor(("0:1",), _flags(str(real_model_path)))
    (address,) = await sup.start()
    port = int(address.rsplit(":", 1)[1])
    try:
        first = sup.procs[0]
        first.kill()
        await first.wait()
        with socket.socket() as squatter:  # the restart cannot bind the address until this goes
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            await asyncio.sleep(8)  # at least one restart attempt fails meanwhile
            assert sup.restarts == 0
        for _ in range(600):
            if sup.restarts:
                break
            await asyncio.sleep(0.1)
        assert sup.restarts == 1 and sup.procs[0] is not first and sup.procs[0].returncode is None
        assert sup.addresses == [address]  # the same address as before
    finally:
        await sup.stop(grace_s=0)  # no grace: the kill path
    assert sup.procs[0].returncode is not None


async def test_spawned_workers_require_the_supervisors_certificate_and_token(real_model_path):
    """Workers bound to loopback are reachable by any local user: they serve mTLS with the supervisor's own CA
    and require its route certificate and its private token."""
    sup = WorkerSupervisor(("0:1",), _flags(str(real_model_path)))
    (address,) = await sup.start()
    route = sup.client_security
    try:
        without = {"plaintext": ClientSecurity(), "no certificate": replace(route, cert_file=None, key_file=None),
                   "no token": replace(route, token="")}
        for what, security in without.items():  # any local process, without one of the three
            async with open_channel(address, security) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await ShardRuntimeStub(channel).GetCapability(spb.ShardCapabilityRequest(), timeout=30)
                assert err.value.code() == (grpc.StatusCode.UNAUTHENTICATED if what == "no token"
                                            else grpc.StatusCode.UNAVAILABLE), what
        async with open_channel(address, route) as authed:
            capability = await ShardRuntimeStub(authed).GetCapability(spb.ShardCapabilityRequest(), timeout=30)
            assert capability.kernels
        folder = sup.credentials_dir
        assert folder.stat().st_mode & 0o777 == 0o700
        assert sorted(p.name for p in folder.iterdir()) == ["ca.pem", "owner.pid", "route.key", "route.pem",
                                                            "token.txt", "worker.key", "worker.pem"]
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in folder.iterdir())
        assert b"PRIVATE KEY" not in sup.pki.ca.read_bytes()  # the CA's key was never written
    finally:
        await sup.stop()
    assert not folder.exists()


async def test_credentials_that_cannot_be_written_fail_the_start_and_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def full_disk(folder, host):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(supervisor_module, "make_spawn_pki", full_disk)
    sup = WorkerSupervisor(("0:1",), _flags(str(tmp_path / "unused")))
    with pytest.raises(OSError, match="No space left"):
        await sup.start()
    assert list(tmp_path.iterdir()) == [] and sup.procs == [None]


def _processes_naming(path: Path) -> list[int]:
    """Live processes whose command line names `path` (the workers given that token file)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(path).encode() in (entry / "cmdline").read_bytes() \
                    and (entry / "stat").read_text().split(") ")[1][0] != "Z":
                pids.append(int(entry.name))
        except OSError:
            continue  # it ended meanwhile
    return pids


async def test_a_worker_that_fails_stops_the_others_and_removes_the_token_file(real_model_path):
    """One worker cannot start (a bad range): the other, still loading, is stopped and the credentials go;
    the failure names the worker's own exit status (not 255 from a reaped-behind-asyncio's-back child)."""
    sup = WorkerSupervisor(("0:1", "1:0"), _flags(str(real_model_path)))
    try:
        with pytest.raises(OSError, match=r"shard worker 1:0 did not start \(exit status 2\)"):
            await sup.start()
        assert sup.credentials_dir is not None and not sup.credentials_dir.exists()
        assert all(p is not None and p.returncode is not None for p in sup.procs)  # none left loading
    finally:
        await sup.stop()


async def test_a_cancelled_start_stops_the_workers_and_removes_the_token_file(real_model_path):
    sup = WorkerSupervisor(("0:1", "1:2"), _flags(str(real_model_path)))
    start = asyncio.ensure_future(sup.start())
    try:
        for _ in range(200):  # both processes exist (loading their layers)
            if all(p is not None for p in sup.procs):
                break
            await asyncio.sleep(0.05)
        token_file = sup.token_file
        assert token_file.exists() and not start.done()
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert not sup.credentials_dir.exists()
        assert all(p.returncode is not None for p in sup.procs) and _processes_naming(token_file) == []
    finally:
        await sup.stop()


@pytest.mark.parametrize("ranges,problem", [
    (("0:10", "12:30"), "layer range 12:30 starts at layer 12, not 10 (layers 10:12 are in no range)"),
    (("10:40",), "layer range 10:40 starts at layer 10, not 0 (layers 0:10 are in no range)"),
    (("0:10", "10:40"), "layer range 10:40 ends past the model's 30 layers"),
    (("0:10", "5:30"), "layer range 5:30 starts at layer 5, not 10 (it overlaps the range before)"),
    (("0:10", "10:20"), "the ranges end at layer 20; the model has 30 layers"),
    (("0:10", "10:10", "10:30"), "layer range '10:10' must satisfy 0 <= START < END"),
])
def test_layer_ranges_must_cover_the_model_in_order(ranges, problem):
    with pytest.raises(ValueError) as err:
        check_layer_ranges(ranges, 30)
    example = {1: "0:30", 2: "0:15,15:30", 3: "0:10,10:20,20:30"}[len(ranges)]
    assert str(err.value) == (f"--spawn-shards {','.join(ranges)}: {problem}: the ranges must cover the model's 30 "
                              f"layers in order without gaps or overlaps, e.g. {example}")
    check_layer_ranges(("0:10", "10:20", "20:30"), 30)
    check_layer_ranges(("0:30",), 30)


@pytest.mark.parametrize("ranges", [("0:1", "1:3"), ("1:2",), ("0:1",)])
async def test_spawn_ranges_that_do_not_fit_the_model_fail_before_any_worker_starts(tiny_engine, tmp_path, monkeypatch,
                                                                                  ranges):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a token file would be made
    spawned: list[tuple[object, ...]] = []

    async def spawn(*args, **kwargs):  # records what would start a worker process
        spawned.append(args)
        raise OSError("the test spawns no worker")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn)
    with pytest.raises(ValueError, match=r"--spawn-shards .*the model's 2 layers"):
        await connect_shards(make_config(spawn_shards=ranges), tiny_engine)
    assert spawned == []  # nothing was spawned
    assert list(tmp_path.iterdir()) == []


def test_sigterm_while_the_spawned_workers_load_stops_them_and_removes_the_token_file(real_model_path, tmp_path):
    """`serve --spawn-shards`, SIGTERM as soon as the workers are spawned: the server exits 0 at once,
    without waiting for them to load, and leaves no worker and no token file behind."""
    log_path = tmp_path / "server.log"
    private = tmp_path / "tmp"
    private.mkdir()
    with open(log_path, "w") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--spawn-shards", "0:10,10:20,20:30",
             "--draft-model", "none", "--max-tile", "16"],
            stdout=subprocess.DEVNULL, stderr=log_file, env={**os.environ, "TMPDIR": str(private)},
        )
    try:
        deadline = time.monotonic() + 300
        while not list(private.glob("inference-engine-shard-*/token.txt")) and time.monotonic() < deadline:
            assert server.poll() is None, log_path.read_text()
            time.sleep(0.05)
        (token_file,) = private.glob("inference-engine-shard-*/token.txt")
        time.sleep(0.5)  # the workers are starting
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, log_path.read_text()
        log = log_path.read_text()
        assert "shutting down while the shard route starts" in log and ") serves at" not in log
        assert not token_file.parent.exists()
        for _ in range(50):  # their SIGTERM was sent, their exit may lag a moment
            if not _processes_naming(token_file):
                break
            time.sleep(0.1)
        assert _processes_naming(token_file) == []
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_dead_servers_credentials_are_removed_at_the_next_start(tmp_path):
    """A SIGKILLed server leaves its token and keys in its folder: the next start removes the folder of a
    server that no longer runs, and keeps a running one's, a folder without an owner and another file."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folders = {}
    for name, owner in (("dead", dead.stdout.strip()), ("alive", str(os.getpid())), ("unowned", None)):
        folders[name] = tmp_path / f"{supervisor_module.CREDENTIALS_PREFIX}{name}"
        folders[name].mkdir(mode=0o700)
        (folders[name] / "token.txt").write_text("secret\n")
        if owner is not None:
            (folders[name] / supervisor_module.OWNER_FILE).write_text(owner + "\n")
    other = tmp_path / "unrelated"
    other.mkdir()
    assert supervisor_module.remove_orphaned_credentials(tmp_path) == [folders["dead"]]
    assert not folders["dead"].exists() and folders["alive"].exists() and folders["unowned"].exists()
    assert other.exists()
