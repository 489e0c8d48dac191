"""--persist-sessions on a full disk (a small tmpfs this test mounts; it needs root): a session whose
latest state could not be written is never restored as if it were current. Its older file is set
aside at the failure and dropped at the next start (logged with its short hash); the failures
show in /metrics and in the health service `inference_engine.persistence`."""

import contextlib
import errno
import logging
import os
import subprocess

import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_engine import metrics
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.persistence import STALE, open_persistence
from inference_engine.runtime.session_transfer import SessionTransfer
from inference_engine.server.health import PERSISTENCE
from inference_engine.server.server import _health_follows
from inference_engine.session import snapshot_format as fmt
from inference_engine.short_id import short_id
from inference_engine.v1 import runtime_pb2 as pb
from tests.ops_helpers import serving
from tests.test_persistence import _settled

PROMPT = np.random.default_rng(6).integers(2, 256, 20).tolist()
MORE = [3, 5, 7]


@pytest.fixture(scope="module")
def engine(tiny):
    e = Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8)
    yield e
    e.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs at tmp_path/disk, unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount rights): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk) -> None:
    """Write a filler file until the disk is full."""
    with open(disk / "filler", "ab") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
    probe = disk / "probe"
    with pytest.raises(OSError) as full:
        probe.write_bytes(b"\0" * 65536)
    probe.unlink(missing_ok=True)
    assert full.value.errno == errno.ENOSPC


def _failures() -> float:
    return metrics.REGISTRY.get_sample_value("inference_engine_persist_failures_total")


async def _health(served) -> int:
    stub = health_pb2_grpc.HealthStub(served.channel())
    return (await stub.Check(health_pb2.HealthCheckRequest(service=PERSISTENCE))).status


async def test_a_full_disk_never_brings_back_a_stale_session(engine, small_disk, caplog):
    caplog.set_level(logging.INFO)
    folder = small_disk / "sessions"
    async with serving(engine) as served:
        p = await open_persistence(SessionTransfer(served.runtime), folder, 1, 0)
        p.on_durability = _health_follows(served.frontend)
        stub = served.stub()
        a, b = [(await stub.CreateSession(pb.CreateSessionRequest())).session_id for _ in range(2)]
        for sid in (a, b):
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        await _settled(p)
        assert await _health(served) == health_pb2.HealthCheckResponse.SERVING
        failures = _failures()

        _fill(small_disk)  # every call from now on is acknowledged, and cannot be written
        for sid in (a, b):
            assert (await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=MORE))).history_length \
                == len(PROMPT) + len(MORE)
        await _settled(p)
        for sid in (a, b):  # the files holding PROMPT only are set aside at once
            assert not p.path(sid).exists() and p.path(sid).with_name(p.path(sid).name + STALE).exists()
        assert _failures() == failures + 2
        assert metrics.REGISTRY.get_sample_value("inference_engine_persist_unwritten_sessions") == 2
        await _settled(p)
        assert await _health(served) == health_pb2.HealthCheckResponse.NOT_SERVING

        (small_disk / "filler").unlink()  # room again: A's next call is written, its stale file goes
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=a, tokens=MORE))
        await _settled(p)
        assert fmt.decode(p.path(a).read_bytes()).history_length == len(PROMPT) + 2 * len(MORE)
        assert sorted(f.name for f in folder.iterdir()) == sorted([p.path(a).name, p.path(b).name + STALE])

        _fill(small_disk)
        assert await p.close() == 0  # B still cannot be written at shutdown
        assert f"session {short_id(b)} could not be written at shutdown" in caplog.text
    (small_disk / "filler").unlink()
    caplog.clear()
    async with serving(engine) as served:
        p = await open_persistence(SessionTransfer(served.runtime), folder, 1, 0)
        assert [s.session_id for s in served.runtime.store.sessions()] == [a]  # B is gone, not back at PROMPT
        info = await served.stub().GetSessionInfo(pb.GetSessionInfoRequest(session_id=a))
        assert info.history_length == len(PROMPT) + 2 * len(MORE)
        assert f"session {short_id(b)} not restored: its latest state could not be written" in caplog.text
        assert [f.name for f in folder.iterdir()] == [p.path(a).name]
        await p.close()
