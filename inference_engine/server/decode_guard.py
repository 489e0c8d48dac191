"""Undecodable requests (corrupt wire bytes, invalid UTF-8 in a string field) are INVALID_ARGUMENT.

grpc.aio deserializes a request before any servicer code runs; a DecodeError there
becomes UNKNOWN with a traceback in the log. This interceptor swaps in a deserializer
that turns the error into a marker, and a behavior that answers the marker with
INVALID_ARGUMENT (reason MALFORMED_REQUEST) and one WARNING line.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from inference_engine.errors import MalformedRequest
from inference_engine.server.error_details import abort_with
from inference_engine.server.handler_wrap import wrap_handler

log = logging.getLogger(__name__)


class Undecodable:
    """Stands for a request whose bytes did not decode."""

    def __init__(self, error: str):
        self.error = error  # the decoder's message (names the message type, never the bytes)


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except (DecodeError, UnicodeDecodeError) as exc:
            return Undecodable(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    return decode


async def _refuse(method: str, bad: Undecodable, context: grpc.aio.ServicerContext) -> None:
    log.warning("malformed request to %s from %s: %s", method, context.peer(), bad.error)
    await abort_with(context, MalformedRequest(
        f"the request to {method} could not be decoded ({bad.error}): corrupt wire bytes, a message of "
        "another type, or invalid UTF-8 in a string field"))


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Answers undecodable requests with INVALID_ARGUMENT instead of UNKNOWN."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method

        async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Undecodable):
                    await _refuse(method, request, context)
                yield request

        @contextlib.asynccontextmanager
        async def guard(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await _refuse(method, request, context)
            yield checked(request, context) if handler.request_streaming else request

        guarded = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        return wrap_handler(guarded, guard)
