"""Wrap a grpc.aio method handler's behavior in an async context manager (for interceptors).

grpc.aio interceptors get a handler and may return another; this replaces its behavior
with one that runs inside `middleware(request, context)`, for coroutine behaviors
(responses written with `context.write` or returned) and async-generator ones alike.
"""

from __future__ import annotations

import inspect
from typing import Any, AsyncContextManager, AsyncIterator, Callable

import grpc

# Entered around the call; yields the request (or request iterator) to pass on, possibly replaced.
Middleware = Callable[[Any, grpc.aio.ServicerContext], AsyncContextManager[Any]]


def behavior_kind(handler: grpc.RpcMethodHandler) -> str:
    """The RpcMethodHandler attribute holding the behavior (`unary_unary`, ..., `stream_stream`)."""
    return ("stream_" if handler.request_streaming else "unary_") + ("stream" if handler.response_streaming else "unary")


def wrap_handler(handler: grpc.RpcMethodHandler, middleware: Middleware) -> grpc.RpcMethodHandler:
    """`handler` with its behavior run inside `middleware`.

    Args:
        handler: the method handler (a namedtuple, as grpc builds them).
        middleware: context manager entered with (request, context) before the behavior.
    Returns:
        A new handler; a synchronous behavior (run on grpc's thread pool) is returned unwrapped.
    """
    kind = behavior_kind(handler)
    inner = getattr(handler, kind)
    if inspect.isasyncgenfunction(inner):

        async def generator_behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with middleware(request, context) as passed:
                async for response in inner(passed, context):
                    yield response

        return handler._replace(**{kind: generator_behavior})
    if inspect.iscoroutinefunction(inner):

        async def coroutine_behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with middleware(request, context) as passed:
                return await inner(passed, context)

        return handler._replace(**{kind: coroutine_behavior})
    return handler
