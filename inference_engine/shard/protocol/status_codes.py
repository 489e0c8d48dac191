"""The one place shard error codes meet gRPC status codes (both directions)."""

from __future__ import annotations

import grpc

from inference_engine.errors import RuntimeServiceError
from inference_engine.shard.protocol.errors import ShardErrorCode, ShardUnavailable, error_for

_STATUS_OF: dict[ShardErrorCode, grpc.StatusCode] = {
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
# A status without an in-band error frame (the stream or call failed as a whole).
_CODE_OF_STATUS: dict[grpc.StatusCode, ShardErrorCode] = {
    grpc.StatusCode.DEADLINE_EXCEEDED: ShardErrorCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.DATA_LOSS: ShardErrorCode.PAYLOAD_CORRUPT,
    grpc.StatusCode.CANCELLED: ShardErrorCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ShardErrorCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT: ShardErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: ShardErrorCode.SESSION_NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: ShardErrorCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE: ShardErrorCode.UNAVAILABLE,
}


def grpc_status_of(code: ShardErrorCode) -> grpc.StatusCode:
    """gRPC status that ends a stream failed with `code` (INTERNAL if unmapped)."""
    return _STATUS_OF.get(code, grpc.StatusCode.INTERNAL)


def error_of_rpc(exc: grpc.aio.AioRpcError, address: str) -> RuntimeServiceError:
    """The exception a client raises for a failed call to the worker at `address`."""
    return error_of_status(exc.code(), exc.details() or "", address)


def error_of_status(status: grpc.StatusCode, details: str, address: str) -> RuntimeServiceError:
    """The exception for a call to `address` that ended with `status`.

    The status details of a stream that failed closed start with the error code's name
    (`EPOCH_STALE: ...`); a worker that cannot be reached is ShardUnavailable.
    """
    name = details.split(":", 1)[0]
    code = ShardErrorCode.__members__.get(name) or _CODE_OF_STATUS.get(status, ShardErrorCode.INTERNAL)
    if code == ShardErrorCode.UNAVAILABLE:
        return ShardUnavailable(f"shard worker {address} is unavailable: {details or status.name}")
    return error_for(code, f"shard worker {address}: {details or status.name}")
