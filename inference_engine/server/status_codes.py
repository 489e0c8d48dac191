"""The one place runtime errors become gRPC status codes."""

from __future__ import annotations

import grpc

from inference_engine import errors

STATUS_OF: dict[type[errors.RuntimeServiceError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.SessionNotFound: grpc.StatusCode.NOT_FOUND,
    errors.PoolExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.InvariantViolation: grpc.StatusCode.FAILED_PRECONDITION,
    errors.FeatureUnavailable: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SessionBusy: grpc.StatusCode.ABORTED,
    errors.EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    """gRPC code for an exception; anything unexpected is INTERNAL."""
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL
