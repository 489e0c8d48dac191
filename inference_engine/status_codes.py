"""The one place errors become status codes, for both services.

RuntimeService (the front server): each class's gRPC code, rich-error reason and HTTP status.
The HTTP columns serve the OpenAI-compatible API (server/openai_api): its error bodies carry
OpenAI's `type` for the status and our reason, lower-cased, as `code`.

ShardRuntime (a shard worker): the `shard` column is the wire code a worker's error frame
carries for the class (`ShardErrorCode`, the proto enum's numbers), and SHARD_STATUS the
gRPC status that ends a stream failed with that code. The shard protocol's own errors
(epochs, deadlines, CRC, credit, cancel: `shard/protocol/errors.py`) carry their wire code
themselves; on RuntimeService they are INTERNAL, unless they are an EngineUnavailable.
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc

from inference_engine import errors

log = logging.getLogger(__name__)
Abort = Callable[[grpc.aio.ServicerContext, BaseException], Awaitable[None]]  # ends the call with the error's status


class ShardErrorCode(enum.IntEnum):
    """Mirror of the proto enum `ShardErrorCode` (same numbers)."""

    UNSPECIFIED = 0
    EPOCH_STALE = 1
    DEADLINE_EXCEEDED = 2
    PAYLOAD_CORRUPT = 3
    FLOW_CONTROL_VIOLATION = 4
    CANCELLED = 5
    RESOURCE_EXHAUSTED = 6
    INVALID_ARGUMENT = 7
    SESSION_NOT_FOUND = 8
    FAILED_PRECONDITION = 9
    UNAVAILABLE = 10
    INTERNAL = 11


ERROR_DOMAIN = "inference_engine"  # google.rpc.ErrorInfo.domain of every error we send


@dataclass(frozen=True)
class ErrorSpec:
    """How one error class is reported to a client."""

    code: grpc.StatusCode  # the gRPC status code
    reason: str  # google.rpc.ErrorInfo.reason: stable, UPPER_SNAKE_CASE, never reworded
    http: int = 400  # HTTP status of the same error on the OpenAI-compatible API
    retry_after_s: float | None = None  # google.rpc.RetryInfo delay; None = retrying the same call will not help
    shard: ShardErrorCode = ShardErrorCode.INTERNAL  # the wire code of a shard worker's error frame


# Most specific class first is not needed: lookup walks each exception's MRO.
ERROR_SPECS: dict[type[errors.RuntimeServiceError], ErrorSpec] = {
    errors.MalformedRequest: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST", 400, shard=ShardErrorCode.INVALID_ARGUMENT),
    errors.RequestTooLarge: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_TOO_LARGE", 413, shard=ShardErrorCode.INVALID_ARGUMENT),
    errors.SnapshotCorrupt: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "SNAPSHOT_CORRUPT", 400, shard=ShardErrorCode.INVALID_ARGUMENT),
    errors.SnapshotIncompatible: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, "SNAPSHOT_INCOMPATIBLE", 409, shard=ShardErrorCode.FAILED_PRECONDITION),
    errors.InvalidConstraint: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CONSTRAINT", 400, shard=ShardErrorCode.INVALID_ARGUMENT),
    errors.InvalidRequest: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", 400, shard=ShardErrorCode.INVALID_ARGUMENT),
    errors.UnknownModel: ErrorSpec(grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", 404),
    errors.SessionNotFound: ErrorSpec(grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND", 404, shard=ShardErrorCode.SESSION_NOT_FOUND),
    errors.PoolExhausted: ErrorSpec(grpc.StatusCode.RESOURCE_EXHAUSTED, "POOL_EXHAUSTED", 429, retry_after_s=1.0, shard=ShardErrorCode.RESOURCE_EXHAUSTED),
    errors.TooManyTransfers: ErrorSpec(grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_TRANSFERS", 429,
                                       retry_after_s=1.0),
    errors.InvariantViolation: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION", 409, shard=ShardErrorCode.FAILED_PRECONDITION),
    errors.FeatureUnavailable: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, "FEATURE_UNAVAILABLE", 400),
    errors.SessionBusy: ErrorSpec(grpc.StatusCode.ABORTED, "SESSION_BUSY", 409, retry_after_s=0.1),
    errors.EngineUnavailable: ErrorSpec(grpc.StatusCode.UNAVAILABLE, "ENGINE_UNAVAILABLE", 503, retry_after_s=1.0, shard=ShardErrorCode.UNAVAILABLE),
    errors.EngineShutdown: ErrorSpec(grpc.StatusCode.UNAVAILABLE, "ENGINE_SHUTTING_DOWN", 503, retry_after_s=1.0, shard=ShardErrorCode.UNAVAILABLE),
    errors.TokenizerUnavailable: ErrorSpec(grpc.StatusCode.UNAVAILABLE, "TOKENIZER_UNAVAILABLE", 503, retry_after_s=1.0),
    errors.Unauthenticated: ErrorSpec(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", 401),
}
# Classes left out of the shard column (a model not served, a busy session, ...) never come
# from a worker's engine: INTERNAL there too.
INTERNAL = ErrorSpec(grpc.StatusCode.INTERNAL, "INTERNAL", 500)  # anything unexpected

# ShardRuntime: the gRPC status that ends a stream failed closed with each wire code.
SHARD_STATUS: dict[ShardErrorCode, grpc.StatusCode] = {
    ShardErrorCode.EPOCH_STALE: grpc.StatusCode.FAILED_PRECONDITION,
    ShardErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ShardErrorCode.PAYLOAD_CORRUPT: grpc.StatusCode.DATA_LOSS,
    ShardErrorCode.FLOW_CONTROL_VIOLATION: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShardErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ShardErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShardErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ShardErrorCode.SESSION_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ShardErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ShardErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ShardErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}
# ... and back: the wire code of a status that came without an error frame (a call failed as a whole).
SHARD_CODE_OF_STATUS: dict[grpc.StatusCode, ShardErrorCode] = {
    status: code for code, status in SHARD_STATUS.items()
    if code not in (ShardErrorCode.EPOCH_STALE, ShardErrorCode.FLOW_CONTROL_VIOLATION, ShardErrorCode.INTERNAL)
}


def spec_of(exc: BaseException) -> ErrorSpec:
    """How `exc` is reported; anything unexpected is INTERNAL."""
    for cls in type(exc).__mro__:
        if cls in ERROR_SPECS:
            return ERROR_SPECS[cls]
    return INTERNAL


def status_of(exc: BaseException) -> grpc.StatusCode:
    """gRPC code for an exception; anything unexpected is INTERNAL."""
    return spec_of(exc).code


def shard_code_of(exc: BaseException) -> ShardErrorCode:
    """Wire code of an exception on ShardRuntime; anything unexpected is INTERNAL."""
    code = getattr(type(exc), "code", None)  # a shard protocol error carries its own
    return code if isinstance(code, ShardErrorCode) else spec_of(exc).shard


def shard_status_of(code: ShardErrorCode) -> grpc.StatusCode:
    """gRPC status that ends a ShardRuntime stream or call failed with `code` (INTERNAL if unmapped)."""
    return SHARD_STATUS.get(code, grpc.StatusCode.INTERNAL)


async def abort_shard(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End a ShardRuntime call or stream with `exc`'s status; the details start with its wire code's name
    (`EPOCH_STALE: ...`), which a route client reads back (`shard/protocol/errors.py`)."""
    code = shard_code_of(exc)
    await context.abort(shard_status_of(code), f"{code.name}: {exc}")


def mapped(abort: Abort, before: Callable[[Any, grpc.aio.ServicerContext], tuple] | None = None) -> Callable:
    """Decorate a servicer's unary methods: errors end the call through `abort`, unexpected ones logged.

    The one error boundary of RuntimeService and ShardRuntime alike; each passes its own
    `abort` (its wire's statuses and details, from this table).

    Args:
        abort: ends the call with an error's status (a RuntimeServiceError's, or INTERNAL).
        before: run first with (servicer, context); what it returns is passed to the method
            after the context (RuntimeService: the caller's identity). It may raise.
    """

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                extra = () if before is None else before(self, context)
                return await method(self, request, context, *extra)
            except grpc.aio.AbortError:  # already answered (an undecodable message of a client stream): as it is
                raise
            except Exception as exc:  # noqa: BLE001 - mapped once, unexpected ones logged
                if not isinstance(exc, errors.RuntimeServiceError):
                    log.exception("unexpected error in %s", method.__name__)
                await abort(context, exc)

        return wrapper

    return decorate
