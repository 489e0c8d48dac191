"""Errors as google.rpc.Status: the code and message as before, plus machine-readable details.

Every status carries an ErrorInfo (a stable `reason` per error class, domain
`inference_engine`); INVALID_ARGUMENT adds a BadRequest naming the field, and the codes a
client should retry (RESOURCE_EXHAUSTED, ABORTED, UNAVAILABLE) add a RetryInfo. Clients
read them with `grpc_status.rpc_status.from_call(error)`.
"""

from __future__ import annotations

from typing import NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from inference_engine.errors import InvalidRequest
from inference_engine.status_codes import ERROR_DOMAIN, spec_of


def _packed(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def rich_status(exc: BaseException, message: str) -> status_pb2.Status:
    """The google.rpc.Status a client receives for `exc`.

    Args:
        exc: the error (its class picks code, reason and retry delay; see status_codes.py).
        message: the status message (what was wrong and what is allowed).
    Returns:
        A Status with code, message and details (ErrorInfo, then BadRequest or RetryInfo).
    """
    spec = spec_of(exc)
    details = [_packed(error_details_pb2.ErrorInfo(reason=spec.reason, domain=ERROR_DOMAIN))]
    field = getattr(exc, "field", "") if isinstance(exc, InvalidRequest) else ""
    if field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    if spec.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(spec.retry_after_s * 1e9))
        details.append(_packed(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(code=spec.code.value[0], message=message, details=details)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, message: str | None = None) -> NoReturn:
    """End the RPC with `exc`'s status and rich details.

    Args:
        context: the call's servicer context.
        exc: the error.
        message: status message; default `str(exc)`.
    Raises:
        The AbortError of grpc.aio (always: this ends the call).
    """
    status = rpc_status.to_status(rich_status(exc, str(exc) if message is None else message))
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
