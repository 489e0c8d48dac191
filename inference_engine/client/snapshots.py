"""Client helpers for session snapshots: the chunked SnapshotSession / RestoreSession streams as bytes.

    data = await snapshot_bytes(stub, session_id)          # the whole snapshot
    restored = await restore_bytes(other_stub, data)       # a new session on another server
    same = restored.state_digest == (await stub.GetSessionInfo(...)).state_digest

Blocking code uses `snapshot_bytes_sync` / `restore_bytes_sync` with a synchronous stub.
"""

from __future__ import annotations

from typing import Any, Iterator

from inference_engine.v1 import runtime_pb2 as pb

CHUNK_BYTES = 1 << 20  # bytes per RestoreSessionRequest (under gRPC's 4 MiB message limit)


def _requests(data: bytes) -> Iterator[pb.RestoreSessionRequest]:
    view = memoryview(data)
    for offset in range(0, len(view), CHUNK_BYTES):
        yield pb.RestoreSessionRequest(data=bytes(view[offset : offset + CHUNK_BYTES]))


async def snapshot_bytes(stub: Any, session_id: str, **call: Any) -> bytes:
    """The session's snapshot, its chunks joined (`call`: metadata, timeout, ...).

    Raises:
        grpc.aio.AioRpcError: as SnapshotSession answers.
    """
    parts = [msg.data async for msg in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=session_id), **call)]
    return b"".join(parts)


async def restore_bytes(stub: Any, data: bytes, **call: Any) -> pb.RestoreSessionResponse:
    """A new session from snapshot bytes (`call`: metadata, timeout, ...).

    Raises:
        grpc.aio.AioRpcError: as RestoreSession answers.
    """
    return await stub.RestoreSession(_requests(data), **call)


def snapshot_bytes_sync(stub: Any, session_id: str, **call: Any) -> bytes:
    """`snapshot_bytes` for a synchronous stub."""
    return b"".join(msg.data for msg in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=session_id),
                                                             **call))


def restore_bytes_sync(stub: Any, data: bytes, **call: Any) -> pb.RestoreSessionResponse:
    """`restore_bytes` for a synchronous stub."""
    return stub.RestoreSession(_requests(data), **call)
