"""ShardRuntime over grpc.aio: one worker's engine behind the shard protocol."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from inference_engine.errors import InvalidRequest, RuntimeServiceError, SessionNotFound
from inference_engine.runtime.batch_queue import BatchQueue
from inference_engine.runtime.scheduler import Scheduler
from inference_engine.security.auth_interceptor import token_interceptors
from inference_engine.security.credentials import SERVER_OPTIONS, bind
from inference_engine.security.settings import ServerSecurity
from inference_engine.status_codes import abort_shard, mapped
from inference_engine.shard.protocol.errors import ShardUnavailable
from inference_engine.shard.protocol.types import ShardOutput, StepItem
from inference_engine.shard.protocol.wire import (
    CHANNEL_OPTIONS, capability_msg, check, error_frame, frame_header, health_msg, step_of,
)
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.shard.worker.route_table import RouteTable
from inference_engine.shard.worker.session_stream import SessionStream
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.execution.executor import Backend
from inference_engine.v1 import shard_runtime_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
RELEASE_WAIT_S = 30.0  # Release waits this long for a running item to stop


_mapped = mapped(abort_shard)


def _no_jobs() -> Backend:
    raise AssertionError("a shard worker starts no scheduler jobs: its blocks come as plain calls")


class ShardRuntimeServicer(pb_grpc.ShardRuntimeServicer):
    """Converts and validates shard frames; runs the engine on its own thread."""

    def __init__(self, engine: MlxShardEngine, max_credits: int = 8, default_credits: int = 4):
        """
        Args:
            engine: a loaded MlxShardEngine.
            max_credits: most work frames a session may have in flight.
            default_credits: credits of a session that asks for 0.
        """
        self.engine = engine
        self.max_credits = max_credits
        self.default_credits = min(default_credits, max_credits)
        # The runtime's engine thread (its plain calls) runs this engine's work; the blocks of
        # sessions waiting at once go to it together (`BatchQueue`): one batched forward.
        self.thread = Scheduler(_no_jobs, max_rows=1, name="shard-engine")
        self.batcher: BatchQueue[StepItem, ShardOutput] = BatchQueue(self.thread, engine.step_many)
        self.routes = RouteTable()

    @_mapped
    async def GetCapability(self, request: pb.ShardCapabilityRequest,
                            context: grpc.aio.ServicerContext) -> pb.ShardCapability:
        return capability_msg(self.engine.capabilities(), self.max_credits)

    @_mapped
    async def Health(self, request: pb.ShardHealthRequest, context: grpc.aio.ServicerContext) -> pb.ShardHealthResponse:
        return health_msg(self.engine.health(), self.engine.metrics())

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        stream = SessionStream(self.engine, self.thread, self.batcher, self.routes, context, self.max_credits, self.default_credits)
        await stream.serve()

    async def Batch(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """Each request's entries run as their sessions' own frames would; one response per request, in order."""
        async for request in request_iterator:
            answers = await asyncio.gather(*(self._batch_entry(e) for e in request.entries))
            await context.write(pb.ShardBatchResponse(frames=answers))

    async def _batch_entry(self, entry: pb.ShardBatchEntry) -> pb.ShardResponseFrame:
        """The answer to one Batch entry: its session's, or why it has no live session here."""
        frame = entry.frame
        kind = frame.WhichOneof("frame")
        step = step_of(frame) if kind in ("chunk", "decode") else 0
        try:
            if kind not in ("chunk", "decode"):
                raise InvalidRequest(f"a Batch entry carries a chunk or decode frame, not {kind or 'nothing'}")
            check("route_session_id#", len(entry.route_session_id))
            epoch = frame_header(frame).epoch
            stream = self.routes.live(entry.route_session_id, epoch, "a Batch entry")
            if stream is None:
                raise SessionNotFound(f"route session {entry.route_session_id!r} is not open here at route epoch {epoch}")
        except Exception as exc:  # noqa: BLE001 - answered in the entry's place; the batch goes on
            if not isinstance(exc, RuntimeServiceError):
                log.exception("unexpected error routing a Batch entry")
            return error_frame(exc, step, session_closed=True)
        return await stream.submit(frame)

    @_mapped
    async def Cancel(self, request: pb.ShardCancelRequest, context: grpc.aio.ServicerContext) -> pb.ShardCancelResponse:
        check("route_session_id#", len(request.route_session_id))
        existed, cancelled = self.routes.cancel(request.route_session_id, check("route_epoch", request.route_epoch),
                                                check("work_id", request.work_id))
        return pb.ShardCancelResponse(session_existed=existed, cancelled=cancelled)

    @_mapped
    async def Release(self, request: pb.ShardReleaseRequest,
                      context: grpc.aio.ServicerContext) -> pb.ShardReleaseResponse:
        check("route_session_id#", len(request.route_session_id))
        stream = self.routes.live(request.route_session_id, check("route_epoch", request.route_epoch), "Release")
        if stream is None:
            return pb.ShardReleaseResponse(existed=False)
        stream.release()
        # Answer once the caches are freed, so a released slot can be reused at once.
        await asyncio.wait_for(stream.closed.wait(), RELEASE_WAIT_S)
        return pb.ShardReleaseResponse(existed=True)

    def fail_sessions(self, reason: str) -> None:
        """Fail every live session closed with UNAVAILABLE (shutdown: clients rebuild elsewhere)."""
        for stream in self.routes.all_live():
            stream.fail(ShardUnavailable(reason))

    def close(self) -> None:
        """Stop the engine thread (after the server has stopped)."""
        self.thread.close()


async def start_shard_server(engine: MlxShardEngine, host: str, port: int, max_credits: int = 8,
                             security: ServerSecurity | None = None) -> tuple[grpc.aio.Server, int, ShardRuntimeServicer]:
    """Load `engine` (if needed) and serve it on host:port.

    Args:
        security: TLS, mTLS and bearer tokens of the port (None = plaintext, no token check).
    Returns:
        The started server, the bound port, and the servicer (`fail_sessions` before
        stopping the server, `close` after).
    Raises:
        OSError: the address cannot be bound, or a certificate, key or token file cannot be read.
        ValueError: the token file is malformed.
    """
    security = security or ServerSecurity()
    interceptors = token_interceptors(security)
    engine.load()
    servicer = ShardRuntimeServicer(engine, max_credits=max_credits)
    server = grpc.aio.server(options=[*CHANNEL_OPTIONS, *SERVER_OPTIONS], interceptors=interceptors)
    pb_grpc.add_ShardRuntimeServicer_to_server(servicer, server)
    bound = bind(server, f"{host}:{port}", security)
    await server.start()
    return server, bound, servicer
