"""Snapshot transfers bounded by configuration, never by the client (tiny model, real grpc.aio server):
a restore is refused or has its slab reserved on its head alone, before its body is taken; transfers
over --max-transfers / --max-transfers-per-identity are RESOURCE_EXHAUSTED with a RetryInfo; a
RestoreSession(file) takes only regular files inside --snapshot-dir, within --max-snapshot-bytes.

A "held" upload sends the snapshot's head and then waits for the test: a server that joined the
whole upload before checking anything would wait with it (these tests would hang, not pass).
"""

import asyncio
import os
import struct

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from inference_engine.client.snapshots import restore_bytes, snapshot_bytes
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.snapshot_intake import SnapshotIntake
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.errors import InvalidRequest, SnapshotCorrupt
from inference_engine.v1 import runtime_pb2 as pb
from tests.certs import TOKEN_A, TOKEN_B, token_file
from tests.conftest import running_server
from tests.ops_helpers import serving

PROMPT = np.random.default_rng(5).integers(2, 256, 30).tolist()
HANG_GUARD_S = 120  # only against a hang; nothing here is timed


@pytest.fixture(scope="module")
def engine(tiny):
    e = Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8)
    yield e
    e.close()


async def _session(stub, tokens=PROMPT) -> str:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=4, window_tokens=16))).session_id
    if tokens:
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=tokens))
    return sid


def _head_bytes(data: bytes) -> int:
    """Bytes of the snapshot's preamble and header."""
    return 16 + struct.unpack_from("<8sII", data)[2]


class HeldUpload:
    """RestoreSession requests: the head (and a few body bytes), then nothing until `release`."""

    def __init__(self, data: bytes):
        self.data = data
        self.released = asyncio.Event()

    async def requests(self):
        cut = _head_bytes(self.data) + 8
        yield pb.RestoreSessionRequest(data=self.data[:cut])
        await self.released.wait()
        yield pb.RestoreSessionRequest(data=self.data[cut:])


def _details(err: grpc.aio.AioRpcError) -> tuple[str, float | None]:
    """ErrorInfo.reason and the RetryInfo delay (None without one)."""
    reason, delay = "", None
    for packed in rpc_status.from_call(err).details:
        info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        if packed.Unpack(info):
            reason = info.reason
        elif packed.Unpack(retry):
            delay = retry.retry_delay.ToNanoseconds() / 1e9
    return reason, delay


async def _error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(coro, HANG_GUARD_S)
    return err.value


async def _until(predicate) -> None:
    for _ in range(HANG_GUARD_S * 100):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


async def test_refused_on_the_head_before_the_body(engine):
    """Pool full, a window over the limits, a declared size over --max-snapshot-bytes: answered while the
    body has not been sent."""
    async with running_server(engine, max_sessions=2) as (stub, runtime):
        sid = await _session(stub)
        data = await snapshot_bytes(stub, sid)
        await _session(stub, tokens=[])
        held = HeldUpload(data)
        err = await _error(stub.RestoreSession(held.requests()))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 session slabs" in err.details()
        assert not held.released.is_set() and runtime.store.slabs_in_use == 2
    async with running_server(engine, max_window=8, default_window=8) as (stub, runtime):
        err = await _error(stub.RestoreSession(HeldUpload(data).requests()))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "sink 4 and window 16" in err.details()
        assert runtime.store.slabs_in_use == 0
    async with running_server(engine, max_snapshot_bytes=len(data) - 1) as (stub, runtime):
        err = await _error(stub.RestoreSession(HeldUpload(data).requests()))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == f"the snapshot declares {len(data)} bytes; allowed up to {len(data) - 1} " \
            "(--max-snapshot-bytes)"
        assert runtime.store.slabs_in_use == 0


async def test_the_slab_is_reserved_before_the_body(engine):
    async with running_server(engine, max_sessions=2) as (stub, runtime):
        sid = await _session(stub)
        data = await snapshot_bytes(stub, sid)
        held = HeldUpload(data)
        restoring = asyncio.ensure_future(stub.RestoreSession(held.requests()))
        await _until(lambda: runtime.store.slabs_in_use == 2)  # the head is in: its slab is held
        err = await _error(stub.CreateSession(pb.CreateSessionRequest()))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.released.set()
        restored = await asyncio.wait_for(restoring, HANG_GUARD_S)
        assert restored.state_digest == (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
                                         ).state_digest
        assert runtime.store.slabs_in_use == 2


async def test_a_body_past_its_declared_size_is_refused(engine):
    async with running_server(engine) as (stub, runtime):
        data = await snapshot_bytes(stub, await _session(stub))
        err = await _error(restore_bytes(stub, data + b"\0" * 100))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == f"the snapshot runs past the {len(data)} bytes its header declares"
        err = await _error(restore_bytes(stub, data[:-1]))
        assert err.details() == f"the snapshot ends after {len(data) - 1} bytes of the {len(data)} its header " \
            "declares: it is truncated; nothing was restored"
        assert runtime.store.slabs_in_use == 1


async def test_transfers_over_the_bounds_are_resource_exhausted(engine, tmp_path):
    security = ServerSecurity(auth_token_file=token_file(tmp_path, TOKEN_A, TOKEN_B))
    async with serving(engine, security, max_transfers=2, max_transfers_per_identity=1) as served:
        a, b = served.stub(ClientSecurity(token=TOKEN_A)), served.stub(ClientSecurity(token=TOKEN_B))
        sid_a, sid_b = await _session(a), await _session(b)
        data = await snapshot_bytes(a, sid_a)
        held = HeldUpload(data)
        restoring = asyncio.ensure_future(a.RestoreSession(held.requests()))
        await _until(lambda: served.runtime.store.slabs_in_use == 3)
        # A's one slot is held: A's snapshot stream and restore are refused, B's snapshot stream is not.
        for call in (snapshot_bytes(a, sid_a), restore_bytes(a, data)):
            err = await _error(call)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-transfers-per-identity" in \
                err.details()
            assert _details(err) == ("TOO_MANY_TRANSFERS", 1.0)
        held_b = HeldUpload(await snapshot_bytes(b, sid_b))  # B's own slot is free
        restoring_b = asyncio.ensure_future(b.RestoreSession(held_b.requests()))
        await _until(lambda: served.runtime.store.slabs_in_use == 4)
        err = await _error(snapshot_bytes(b, sid_b))  # both slots held
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "(--max-transfers);" in err.details()
        held.released.set()
        held_b.released.set()
        for call in (restoring, restoring_b):
            assert (await asyncio.wait_for(call, HANG_GUARD_S)).history_length == len(PROMPT)
        await _until(lambda: served.frontend.servicer.transfer.slots.open == 0)
        assert await snapshot_bytes(a, sid_a) == data  # the slots came back


async def test_file_restore_takes_regular_files_inside_the_folder_within_the_limit(engine, tmp_path):
    folder, outside = tmp_path / "snaps", tmp_path / "outside"
    outside.mkdir()
    async with running_server(engine, snapshot_dir=folder) as (stub, runtime):
        sid = await _session(stub)
        (msg,) = [m async for m in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))]
        size = (folder / msg.file).stat().st_size
        # A symlink to a snapshot of the caller's own outside the folder: not followed.
        (folder / msg.file).rename(outside / msg.file)
        os.symlink(outside / msg.file, folder / "link.iesnap")
        err = await _error(stub.RestoreSession(iter([pb.RestoreSessionRequest(file="link.iesnap")])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "is a symbolic link" in err.details()
        os.mkfifo(folder / "pipe.iesnap")  # opened without blocking, refused as not regular
        err = await _error(stub.RestoreSession(iter([pb.RestoreSessionRequest(file="pipe.iesnap")])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a regular file" in err.details()
        (outside / msg.file).rename(folder / msg.file)
        assert runtime.store.slabs_in_use == 1
    async with running_server(engine, snapshot_dir=folder, max_snapshot_bytes=size - 1) as (stub, runtime):
        err = await _error(stub.RestoreSession(iter([pb.RestoreSessionRequest(file=msg.file)])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == f"snapshot file {msg.file!r} has {size} bytes; allowed up to {size - 1} " \
            "(--max-snapshot-bytes)"
    async with running_server(engine, snapshot_dir=folder, max_snapshot_bytes=size) as (stub, runtime):
        restored = await stub.RestoreSession(iter([pb.RestoreSessionRequest(file=msg.file)]))
        assert restored.history_length == len(PROMPT)


def test_intake_holds_the_head_until_accepted_and_then_one_buffer():
    """No body memory before the head is back from the caller; then exactly the declared size."""
    from inference_engine.session import snapshot_format as fmt
    from tests.test_snapshot_format import _snapshot

    data = fmt.encode(_snapshot())
    head_end = _head_bytes(data)
    intake = SnapshotIntake(len(data))
    assert intake.feed(data[:10]) is None and intake.feed(data[10 : head_end - 1]) is None
    head = intake.feed(data[head_end - 1 : head_end + 3])
    assert head is not None and head.total_bytes == len(data) and intake._buffer is None
    intake.feed(data[head_end + 3 :])
    assert bytes(intake.finish()) == data and len(intake._buffer) == len(data)
    with pytest.raises(SnapshotCorrupt, match="no snapshot header"):
        SnapshotIntake(10).feed(b"\x89IESNAX")
    with pytest.raises(InvalidRequest, match="needs the snapshot"):
        SnapshotIntake(10).finish()
    with pytest.raises(SnapshotCorrupt, match="truncated"):
        short = SnapshotIntake(len(data))
        short.feed(data[:12])
        short.finish()
