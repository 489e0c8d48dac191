"""Rejects calls without a known bearer token (UNAUTHENTICATED) before any servicer runs."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import grpc

from inference_engine.security.authenticator import MISSING_TOKEN, Authenticator
from inference_engine.security.settings import ServerSecurity

Reject = Callable[[grpc.aio.ServicerContext, str], Awaitable[None]]
HEALTH_PREFIX = "/grpc.health.v1.Health/"  # open: probes carry no secrets and learn only SERVING / NOT_SERVING


async def plain_reject(context: grpc.aio.ServicerContext, message: str) -> None:
    """End the call UNAUTHENTICATED with `message`."""
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)


def _kind(handler: grpc.RpcMethodHandler) -> str:
    streaming = (handler.request_streaming, handler.response_streaming)
    return {(False, False): "unary_unary", (False, True): "unary_stream",
            (True, False): "stream_unary", (True, True): "stream_stream"}[streaming]


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <token>` on every call but the open ones."""

    def __init__(self, authenticator: Authenticator, open_prefixes: tuple[str, ...] = (HEALTH_PREFIX,),
                 reject: Reject = plain_reject):
        """
        Args:
            authenticator: knows the tokens (it must have some).
            open_prefixes: method paths served without a token.
            reject: ends a refused call (the RuntimeService server sends rich details).
        """
        assert authenticator.tokens is not None, "a token check needs tokens"
        self.authenticator = authenticator
        self.open_prefixes = open_prefixes
        self.reject = reject

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.open_prefixes):
            return handler
        if self.authenticator.identity_of_metadata(details.invocation_metadata) is not None:
            return handler

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await self.reject(context, MISSING_TOKEN)

        return handler._replace(**{_kind(handler): refuse})


def token_interceptors(security: ServerSecurity) -> list[grpc.aio.ServerInterceptor]:
    """The token check for a server with `security` ([] when it has no token file).

    Raises:
        OSError, ValueError: the token file cannot be read or is malformed.
    """
    authenticator = Authenticator.from_security(security)
    return [BearerAuthInterceptor(authenticator)] if authenticator.tokens is not None else []
