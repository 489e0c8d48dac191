"""The one place runtime errors become gRPC status codes, rich-error reasons and HTTP statuses.

The HTTP columns serve the OpenAI-compatible API (server/openai_api): its error bodies carry
OpenAI's `type` for the status and our reason, lower-cased, as `code`.
"""

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
    http: int = 400  # HTTP status of the same error on the OpenAI-compatible API
    retry_after_s: float | None = None  # google.rpc.RetryInfo delay; None = retrying the same call will not help


# Most specific class first is not needed: lookup walks each exception's MRO.
ERROR_SPECS: dict[type[errors.RuntimeServiceError], ErrorSpec] = {
    errors.MalformedRequest: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST", 400),
    errors.RequestTooLarge: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_TOO_LARGE", 413),
    errors.SnapshotCorrupt: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "SNAPSHOT_CORRUPT", 400),
    errors.SnapshotIncompatible: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, "SNAPSHOT_INCOMPATIBLE", 409),
    errors.InvalidConstraint: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CONSTRAINT", 400),
    errors.InvalidRequest: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", 400),
    errors.UnknownModel: ErrorSpec(grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", 404),
    errors.SessionNotFound: ErrorSpec(grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND", 404),
    errors.PoolExhausted: ErrorSpec(grpc.StatusCode.RESOURCE_EXHAUSTED, "POOL_EXHAUSTED", 429, retry_after_s=1.0),
    errors.TooManyTransfers: ErrorSpec(grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_TRANSFERS", 429,
                                       retry_after_s=1.0),
    errors.InvariantViolation: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION", 409),
    errors.FeatureUnavailable: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, "FEATURE_UNAVAILABLE", 400),
    errors.SessionBusy: ErrorSpec(grpc.StatusCode.ABORTED, "SESSION_BUSY", 409, retry_after_s=0.1),
    errors.EngineUnavailable: ErrorSpec(grpc.StatusCode.UNAVAILABLE, "ENGINE_UNAVAILABLE", 503, retry_after_s=1.0),
    errors.EngineShutdown: ErrorSpec(grpc.StatusCode.UNAVAILABLE, "ENGINE_SHUTTING_DOWN", 503, retry_after_s=1.0),
    errors.Unauthenticated: ErrorSpec(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", 401),
}
INTERNAL = ErrorSpec(grpc.StatusCode.INTERNAL, "INTERNAL", 500)  # anything unexpected


def spec_of(exc: BaseException) -> ErrorSpec:
    """How `exc` is reported; anything unexpected is INTERNAL."""
    for cls in type(exc).__mro__:
        if cls in ERROR_SPECS:
            return ERROR_SPECS[cls]
    return INTERNAL


def status_of(exc: BaseException) -> grpc.StatusCode:
    """gRPC code for an exception; anything unexpected is INTERNAL."""
    return spec_of(exc).code
