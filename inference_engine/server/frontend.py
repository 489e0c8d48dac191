"""The gRPC front of a server: RuntimeService, health and reflection on one secured port.

It starts before the model is loaded (health NOT_SERVING, RuntimeService UNAVAILABLE),
serves once a runtime is attached, and reports NOT_SERVING again while draining.
Interceptors, outermost first: the RPC observer (log line, metrics), the bearer-token
check, the decode guard (undecodable bytes -> INVALID_ARGUMENT).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inference_engine import metrics
from inference_engine.config import ServerConfig
from inference_engine.errors import Unauthenticated
from inference_engine.runtime.runtime import Runtime
from inference_engine.security.auth_interceptor import BearerAuthInterceptor
from inference_engine.security.authenticator import Authenticator
from inference_engine.security.credentials import SERVER_OPTIONS, bind
from inference_engine.server.decode_guard import DecodeGuard
from inference_engine.server.error_details import abort_with
from inference_engine.server.health import RUNTIME_SERVICE, HealthReporter
from inference_engine.server.rpc_observer import RpcObserver
from inference_engine.server.service_registration import add_runtime_service
from inference_engine.server.servicer import RuntimeServicer
from inference_engine.server.transfer_servicer import TransferServicer

log = logging.getLogger(__name__)
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


async def _reject(context: grpc.aio.ServicerContext, message: str) -> None:
    await abort_with(context, Unauthenticated(message))


def _observe_batch(rows: int, sessions: int, seconds: float) -> None:
    metrics.BATCH_ROWS.observe(rows)


@dataclass
class Frontend:
    """A started gRPC server and the handles to drive its serving state."""

    server: grpc.aio.Server  # the grpc.aio server
    port: int  # the bound port
    servicer: RuntimeServicer  # RuntimeService (attach a runtime to serve)
    health: HealthReporter  # grpc.health.v1 statuses

    async def attach(self, runtime: Runtime) -> None:
        """Serve `runtime` from now on: start its sweeper, point the pool gauges at it, report SERVING."""
        store = runtime.store
        metrics.track_pool(lambda: store.slabs_in_use, store.max_sessions, store.kv_bytes_in_use)
        scheduler = runtime.engine.scheduler
        if _observe_batch not in scheduler.observers:  # an engine may be served more than once (tests)
            scheduler.observers.append(_observe_batch)
        scheduler.on_queue_wait = metrics.QUEUE_WAIT_SECONDS.observe
        self.servicer.attach(runtime)
        runtime.start()
        await self.health.set_serving(True)

    async def drain(self, grace_s: float) -> None:
        """Report NOT_SERVING, then stop taking calls and let running ones finish for up to `grace_s`."""
        await self.health.drain()
        await self.server.stop(grace_s)


async def open_frontend(cfg: ServerConfig, host: str, port: int) -> Frontend:
    """Bind and start the front with `cfg.security`; health NOT_SERVING until `attach`.

    Raises:
        OSError: the address cannot be bound, or a certificate, key or token file cannot be read.
        ValueError: the token file is malformed.
    """
    authenticator = Authenticator.from_security(cfg.security)
    interceptors: list[grpc.aio.ServerInterceptor] = [RpcObserver()]
    if authenticator.tokens is not None:
        interceptors.append(BearerAuthInterceptor(authenticator, reject=_reject))
    interceptors.append(DecodeGuard())
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    servicer = TransferServicer(identify=authenticator.identity_of)  # RuntimeServicer + the snapshot RPCs
    add_runtime_service(servicer, server)  # the generated registration; Tokenize may answer bytes
    health = HealthReporter()
    await health.set_serving(False)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((RUNTIME_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    try:
        bound = bind(server, f"{host}:{port}", cfg.security)
    except BaseException:
        await server.stop(None)
        raise
    await server.start()
    return Frontend(server, bound, servicer, health)


async def start_frontend(runtime: Runtime, host: str, port: int) -> Frontend:
    """Open a front configured by `runtime.config` and attach `runtime` (serving at once)."""
    frontend = await open_frontend(runtime.config, host, port)
    await frontend.attach(runtime)
    return frontend
