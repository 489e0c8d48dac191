"""One log line and the RPC metrics for every call, whatever its outcome.

Outermost interceptor: it also sees calls refused for a missing token or undecodable
bytes. RuntimeService calls log at INFO, health and reflection at DEBUG (probes would
flood the log). Session ids and identities appear only as short hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from inference_engine import metrics
from inference_engine.server import call_record
from inference_engine.server.handler_wrap import wrap_handler
from inference_engine.short_id import short_id

log = logging.getLogger("inference_engine.rpc")
RUNTIME_SERVICE = "inference_engine.v1.RuntimeService"


def _code_after(context: grpc.aio.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # pragma: no cover - set_code with a raw int
        return next((c for c in grpc.StatusCode if c.value[0] == code), default)
    return default


def _line(record: call_record.CallRecord, code: grpc.StatusCode, ms: float) -> tuple[str, dict[str, Any]]:
    """The log message and its structured fields (the JSON formatter emits the fields)."""
    fields: dict[str, Any] = {"method": record.method, "code": code.name, "duration_ms": round(ms, 1)}
    if record.session_id:
        fields["session"] = short_id(record.session_id)
    if record.identity:
        fields["peer"] = short_id(record.identity)
    if record.tokens_in is not None:
        fields["tokens_in"] = record.tokens_in
    if record.tokens_out is not None:
        fields["tokens_out"] = record.tokens_out
    if record.stop_reason:
        fields["stop_reason"] = record.stop_reason
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("method", "code", "duration_ms"))
    return f"rpc {record.method} {code.name} {ms:.1f} ms {text}".rstrip(), fields


class RpcObserver(grpc.aio.ServerInterceptor):
    """Times every call, counts it by method and code, and logs one line for it."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")

        @contextlib.asynccontextmanager
        async def observe(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            record = call_record.begin(method)
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                yield request
                code = _code_after(context, grpc.StatusCode.OK)
            except (asyncio.CancelledError, GeneratorExit):
                code = grpc.StatusCode.CANCELLED
                raise
            except BaseException:
                code = _code_after(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                seconds = time.perf_counter() - start
                metrics.RPCS_HANDLED.labels(service, method, code.name).inc()
                metrics.RPC_SECONDS.labels(service, method).observe(seconds)
                message, fields = _line(record, code, seconds * 1e3)
                log.log(logging.INFO if service == RUNTIME_SERVICE else logging.DEBUG, message, extra={"rpc": fields})

        return wrap_handler(handler, observe)
