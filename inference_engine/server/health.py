"""grpc.health.v1 for RuntimeService: NOT_SERVING until the model is loaded and while draining.

A small servicer over grpcio-health-checking's protocol rather than its stock one: the
stock Watch stream never ends, so each watcher would hold the shutdown for the whole
grace period. Here a drain sends NOT_SERVING to every watcher and ends its stream.

Service PERSISTENCE reports `--persist-sessions`: SERVING while every live session's latest
state is on disk (or nothing is persisted), NOT_SERVING while one could not be written (disk
full): the server still serves, but a restart now would lose those sessions.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_engine.v1 import runtime_pb2

RUNTIME_SERVICE = runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"].full_name
PERSISTENCE = "inference_engine.persistence"  # NOT_SERVING while a session's latest state is not on disk
SERVICE_NAMES = ("", RUNTIME_SERVICE, PERSISTENCE)  # "" is the server as a whole
Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthReporter(health_pb2_grpc.HealthServicer):
    """The Health service: one status per service name, NOT_SERVING until `set_serving(True)`."""

    def __init__(self, names: tuple[str, ...] = SERVICE_NAMES):
        self._status: dict[str, Status] = {name: NOT_SERVING for name in names}
        self._is_draining = False
        self._version = 0  # bumped on every change; watchers wait for a newer one
        self._changed = asyncio.Condition()

    async def _update(self, status: Status, is_draining: bool = False) -> None:
        async with self._changed:
            if self._is_draining:
                return  # NOT_SERVING for good
            self._status = dict.fromkeys(self._status, status)
            self._is_draining = is_draining
            self._version += 1
            self._changed.notify_all()

    async def set_serving(self, is_serving: bool) -> None:
        """SERVING or NOT_SERVING for every service name (ignored once draining)."""
        await self._update(SERVING if is_serving else NOT_SERVING)

    async def set_durable(self, is_durable: bool) -> None:
        """PERSISTENCE: SERVING when every session's latest state is on disk (ignored unless serving)."""
        async with self._changed:
            if self._is_draining or self._status.get("") != SERVING or PERSISTENCE not in self._status:
                return
            self._status[PERSISTENCE] = SERVING if is_durable else NOT_SERVING
            self._version += 1
            self._changed.notify_all()

    async def drain(self) -> None:
        """NOT_SERVING for good (the server is shutting down); open Watch streams end."""
        await self._update(NOT_SERVING, is_draining=True)

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}; known: "
                                f"{', '.join(repr(n) for n in self._status)}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        seen, last = -1, None
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._version != seen)
                seen, status, is_draining = self._version, self._status.get(request.service, SERVICE_UNKNOWN), \
                    self._is_draining
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if is_draining:
                return
