"""RuntimeService's session-transfer RPCs (SnapshotSession, RestoreSession, ForkSession) on the servicer.

A subclass, so the core servicer stays as it is: protobuf in, the frozen dataclasses of
`runtime/session_transfer.py` down, errors mapped once by the same `_mapped`. Snapshots
travel in chunks of SNAPSHOT_CHUNK_BYTES (a snapshot at the default window is ~47 MB,
far over gRPC's 4 MiB message limit). Each call holds a transfer slot from its start to its
end (--max-transfers, --max-transfers-per-identity); a restore's messages are read only as
the restore takes them (its head checked and its slab reserved before the body).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc

from inference_engine.errors import InvalidRequest, RuntimeServiceError
from inference_engine.malloc_trim import trim_free_memory
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.session_transfer import RestoreParams, SessionTransfer, SnapshotParams
from inference_engine.server import call_record
from inference_engine.server.servicer import RuntimeServicer, _mapped
from inference_engine.v1 import runtime_pb2 as pb

SNAPSHOT_CHUNK_BYTES = 1 << 20  # bytes per SnapshotSessionResponse.data
DRAIN_BYTES, DRAIN_S = 4 << 20, 1.0  # what a refused upload may still send, read and dropped (see _drain)
TRIM_DELAY_S = 0.5  # after the last transfer call ends, the heap is trimmed this much later


class TransferServicer(RuntimeServicer):
    """RuntimeServicer plus SnapshotSession, RestoreSession and ForkSession."""

    def attach(self, runtime: Runtime) -> None:
        """Start serving calls with `runtime` (and its session transfers)."""
        self.transfer = SessionTransfer(runtime)
        self._trimming: asyncio.Future | None = None  # a malloc_trim running
        self._calls = 0  # SnapshotSession/RestoreSession calls running, refused ones included
        super().attach(runtime)

    @contextlib.asynccontextmanager
    async def _slot(self, owner: str) -> AsyncIterator[None]:
        """A transfer slot for the call (TooManyTransfers when none is free); once the last transfer ends,
        the heap memory its messages and buffers used goes back to the system."""
        self._calls += 1
        try:
            with self.transfer.slots.hold(owner):
                yield
        finally:
            self._calls -= 1
            if not self._calls:  # once grpc has let go of the calls' messages too
                asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim)

    def _trim(self) -> None:
        if not self._calls and self._trimming is None:
            self._trimming = asyncio.ensure_future(asyncio.to_thread(trim_free_memory))
            self._trimming.add_done_callback(lambda _: setattr(self, "_trimming", None))

    @_mapped
    async def SnapshotSession(self, request: pb.SnapshotSessionRequest, context: grpc.aio.ServicerContext,
                              owner: str) -> None:
        call_record.current().session_id = request.session_id
        params = SnapshotParams(self.validate.session_id(request.session_id), request.to_dir, owner)
        async with self._slot(owner):  # the snapshot's bytes stay in memory until the client read them
            taken = await self.transfer.snapshot(params)
            first = pb.SnapshotSessionResponse(file=taken.file, snapshot_bytes=taken.size,
                                               history_length=taken.history_length, state_digest=taken.state_digest)
            view = memoryview(taken.data)
            for offset in range(0, len(view), SNAPSHOT_CHUNK_BYTES) if view else [0]:
                first.data = bytes(view[offset : offset + SNAPSHOT_CHUNK_BYTES])
                await context.write(first)
                first = pb.SnapshotSessionResponse()

    @_mapped
    async def RestoreSession(self, request: AsyncIterator[pb.RestoreSessionRequest],
                             context: grpc.aio.ServicerContext, owner: str) -> pb.RestoreSessionResponse:
        try:
            async with self._slot(owner):  # before a byte is read
                first = await anext(aiter(request), None)
                if first is not None and first.file:
                    if first.data or await anext(aiter(request), None) is not None:
                        raise _file_alone()
                    params = RestoreParams(b"", first.file, owner)
                else:
                    params = RestoreParams(_data(first, request), "", owner)
                restored = await self.transfer.restore(params)
        except RuntimeServiceError:
            await _drain(request)
            raise
        call_record.current().session_id = restored.session_id
        return pb.RestoreSessionResponse(session_id=restored.session_id, history_length=restored.history_length,
                                         state_digest=restored.state_digest, sink_tokens=restored.sink,
                                         window_tokens=restored.window)

    @_mapped
    async def ForkSession(self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext,
                          owner: str) -> pb.ForkSessionResponse:
        call_record.current().session_id = request.session_id
        forked = await self.transfer.fork(self.validate.session_id(request.session_id), owner)
        return pb.ForkSessionResponse(session_id=forked.session_id, history_length=forked.history_length,
                                      state_digest=forked.state_digest)


async def _drain(request: AsyncIterator[pb.RestoreSessionRequest]) -> None:
    """Read and drop what is left of a refused upload, up to DRAIN_BYTES or DRAIN_S, before the status goes out.

    A client still writing when the status arrives gets grpc's own INTERNAL ("Internal error from
    Core") instead of it; a short upload is read to its end, so its client sees the real code. Nothing
    read here is kept: a hostile upload costs at most the budget's bandwidth.
    """
    async def drop() -> None:
        dropped = 0
        async for message in request:
            dropped += len(message.data)
            if dropped > DRAIN_BYTES:
                return

    with contextlib.suppress(Exception):  # out of time, or the stream broke: the status goes out as it is
        await asyncio.wait_for(drop(), DRAIN_S)


def _file_alone() -> InvalidRequest:
    return InvalidRequest("RestoreSessionRequest.file must come alone: one message naming the file, without data",
                          "file")


async def _data(first: pb.RestoreSessionRequest | None,
                rest: AsyncIterator[pb.RestoreSessionRequest]) -> AsyncIterator[bytes]:
    """The snapshot's bytes from the request stream, message by message (read as the restore takes them)."""
    message = first
    while message is not None:
        if message.file:
            raise _file_alone()
        yield message.data
        message = await anext(aiter(rest), None)
