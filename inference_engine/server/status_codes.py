"""The one place runtime errors become gRPC status codes and rich-error reasons."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from inference_engine import errors

ERROR_DOMAIN = "inference_engine"  # google.rpc.ErrorInfo.domain of every error we send


@dataclass(frozen=True)
class ErrorSpec:
    """How one error class is reported to a client."""

    code: grpc.StatusCode  # the gRPC status code
    reason: str  # google.rpc.ErrorInfo.reason: stable, UPPER_SNAKE_CASE, never reworded
    retry_after_s: float | None = None  # google.rpc.RetryInfo delay; None = retrying the same call will not help


# Most specific class first is not needed: lookup walks each exception's MRO.
ERROR_SPECS: dict[type[errors.RuntimeServiceError], ErrorSpec] = {
    errors.MalformedRequest: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST"),
    errors.SnapshotCorrupt: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "SNAPSHOT_CORRUPT"),
    errors.SnapshotIncompatible: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, "SNAPSHOT_INCOMPATIBLE"),
    errors.InvalidRequest: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"),
    errors.SessionNotFound: ErrorSpec(grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"),
    errors.PoolExhausted: ErrorSpec(grpc.StatusCode.RESOURCE_EXHAUSTED, "POOL_EXHAUSTED", retry_after_s=1.0),
    errors.InvariantViolation: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION"),
    errors.FeatureUnavailable: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, "FEATURE_UNAVAILABLE"),
    errors.SessionBusy: ErrorSpec(grpc.StatusCode.ABORTED, "SESSION_BUSY", retry_after_s=0.1),
    errors.EngineUnavailable: ErrorSpec(grpc.StatusCode.UNAVAILABLE, "ENGINE_UNAVAILABLE", retry_after_s=1.0),
    errors.EngineShutdown: ErrorSpec(grpc.StatusCode.UNAVAILABLE, "ENGINE_SHUTTING_DOWN", retry_after_s=1.0),
    errors.Unauthenticated: ErrorSpec(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"),
}
INTERNAL = ErrorSpec(grpc.StatusCode.INTERNAL, "INTERNAL")  # anything unexpected


def spec_of(exc: BaseException) -> ErrorSpec:
    """How `exc` is reported; anything unexpected is INTERNAL."""
    for cls in type(exc).__mro__:
        if cls in ERROR_SPECS:
            return ERROR_SPECS[cls]
    return INTERNAL


def status_of(exc: BaseException) -> grpc.StatusCode:
    """gRPC code for an exception; anything unexpected is INTERNAL."""
    return spec_of(exc).code
