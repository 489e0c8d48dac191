"""The shard protocol's own errors, and what a route client raises for a worker's error.

Every shard error is a `RuntimeServiceError` (the one hierarchy) carrying its wire code;
the one status table (`inference_engine/status_codes.py`) maps every class to its wire code
(`code_of`) and every wire code to a gRPC status. Here is the other direction: the
exception a client raises for a wire code (`error_for`) or a failed call (`error_of_status`).
"""

from __future__ import annotations

import grpc

from inference_engine.errors import (
    EngineUnavailable,
    InvalidRequest,
    InvariantViolation,
    PoolExhausted,
    RuntimeServiceError,
    SessionNotFound,
)
from inference_engine.status_codes import SHARD_CODE_OF_STATUS, ShardErrorCode


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


def error_for(code: ShardErrorCode, message: str) -> RuntimeServiceError:
    """The exception a client raises for a wire error (INTERNAL and unknown: `ShardError`)."""
    return _ERROR_FOR.get(code, ShardError)(message)


def error_of_rpc(exc: grpc.aio.AioRpcError, address: str) -> RuntimeServiceError:
    """The exception a client raises for a failed call to the worker at `address`."""
    return error_of_status(exc.code(), exc.details() or "", address)


def error_of_status(status: grpc.StatusCode, details: str, address: str) -> RuntimeServiceError:
    """The exception for a call to `address` that ended with `status`.

    The status details of a stream that failed closed start with the error code's name
    (`EPOCH_STALE: ...`); a worker that cannot be reached is ShardUnavailable.
    """
    name = details.split(":", 1)[0]
    code = ShardErrorCode.__members__.get(name) or SHARD_CODE_OF_STATUS.get(status, ShardErrorCode.INTERNAL)
    if code == ShardErrorCode.UNAVAILABLE:
        return ShardUnavailable(f"shard worker {address} is unavailable: {details or status.name}")
    return error_for(code, f"shard worker {address}: {details or status.name}")
