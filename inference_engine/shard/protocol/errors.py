"""The shard protocol's error codes and the exceptions that carry them.

Every shard error is a `RuntimeServiceError`, so the runtime's one hierarchy still holds;
`code_of` and `error_for` translate between exceptions and the wire's `ShardErrorCode`
(gRPC status codes are mapped in `status_codes.py`).
"""

from __future__ import annotations

import enum

from inference_engine.errors import (
    EngineUnavailable,
    InvalidRequest,
    InvariantViolation,
    PoolExhausted,
    RuntimeServiceError,
    SessionNotFound,
)


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


class ShardError(RuntimeServiceError):
    """Base of the shard protocol's own errors; `code` goes on the wire."""

    code = ShardErrorCode.INTERNAL
    retryable = False  # the same frame may be resent on the same stream


class EpochStale(ShardError):
    """A frame or open carries a route epoch older than the session's (or another epoch)."""

    code = ShardErrorCode.EPOCH_STALE


class DeadlineExpired(ShardError):
    """The frame's deadline passed before its work could start (or a reply came too late)."""

    code = ShardErrorCode.DEADLINE_EXCEEDED


class PayloadCorrupt(ShardError):
    """A tensor's fragments leave a gap or overlap, its size is wrong, or its CRC32C mismatches."""

    code = ShardErrorCode.PAYLOAD_CORRUPT


class FlowControlViolation(ShardError):
    """A work frame arrived without credit; resend it after the next FlowControl grant."""

    code = ShardErrorCode.FLOW_CONTROL_VIOLATION
    retryable = True


class WorkCancelled(ShardError):
    """The work item, or its whole session, was cancelled."""

    code = ShardErrorCode.CANCELLED


class MalformedShardOutput(ShardError):
    """A worker answered OK with output of the wrong shape, dtype, position or values."""

    code = ShardErrorCode.INTERNAL


class ShardUnavailable(EngineUnavailable, ShardError):
    """A worker cannot be reached, or its engine is gone."""

    code = ShardErrorCode.UNAVAILABLE


_CODE_OF: dict[type[RuntimeServiceError], ShardErrorCode] = {
    InvalidRequest: ShardErrorCode.INVALID_ARGUMENT,
    SessionNotFound: ShardErrorCode.SESSION_NOT_FOUND,
    PoolExhausted: ShardErrorCode.RESOURCE_EXHAUSTED,
    InvariantViolation: ShardErrorCode.FAILED_PRECONDITION,
    EngineUnavailable: ShardErrorCode.UNAVAILABLE,
}

_ERROR_FOR: dict[ShardErrorCode, type[RuntimeServiceError]] = {
    ShardErrorCode.EPOCH_STALE: EpochStale,
    ShardErrorCode.DEADLINE_EXCEEDED: DeadlineExpired,
    ShardErrorCode.PAYLOAD_CORRUPT: PayloadCorrupt,
    ShardErrorCode.FLOW_CONTROL_VIOLATION: FlowControlViolation,
    ShardErrorCode.CANCELLED: WorkCancelled,
    ShardErrorCode.RESOURCE_EXHAUSTED: PoolExhausted,
    ShardErrorCode.INVALID_ARGUMENT: InvalidRequest,
    ShardErrorCode.SESSION_NOT_FOUND: SessionNotFound,
    ShardErrorCode.FAILED_PRECONDITION: InvariantViolation,
    ShardErrorCode.UNAVAILABLE: ShardUnavailable,
}


def code_of(exc: BaseException) -> ShardErrorCode:
    """Wire code of an exception; anything unexpected is INTERNAL."""
    if isinstance(exc, ShardError):
        return exc.code
    for cls in type(exc).__mro__:
        if cls in _CODE_OF:
            return _CODE_OF[cls]
    return ShardErrorCode.INTERNAL


def error_for(code: ShardErrorCode, message: str) -> RuntimeServiceError:
    """The exception a client raises for a wire error (INTERNAL and unknown: `ShardError`)."""
    return _ERROR_FOR.get(code, ShardError)(message)
