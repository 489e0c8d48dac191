"""How a call ended, read only from what a client receives: the code and the google.rpc.Status.

The "Errors" section of docs/serving.md is the contract checked here: every error the server makes is
typed (an ErrorInfo of domain `inference_engine` whose reason belongs to the code, a RetryInfo
exactly on the codes worth retrying), never UNKNOWN, never INTERNAL for a client's mistake.
A few codes come from the transport itself, without details: a client's own deadline or
cancel, a message over gRPC's size limit, a connection that could not be made.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "inference_engine"  # ErrorInfo.domain of every error the server makes
C = grpc.StatusCode
# ErrorInfo.reason -> the code it comes with (docs/serving.md "Errors"; status_codes.py).
REASON_CODES: dict[str, grpc.StatusCode] = {
    "INVALID_REQUEST": C.INVALID_ARGUMENT,
    "MALFORMED_REQUEST": C.INVALID_ARGUMENT,
    "INVALID_CONSTRAINT": C.INVALID_ARGUMENT,
    "SNAPSHOT_CORRUPT": C.INVALID_ARGUMENT,
    "SNAPSHOT_INCOMPATIBLE": C.FAILED_PRECONDITION,
    "SESSION_NOT_FOUND": C.NOT_FOUND,
    "POOL_EXHAUSTED": C.RESOURCE_EXHAUSTED,
    "TOO_MANY_TRANSFERS": C.RESOURCE_EXHAUSTED,
    "FAILED_PRECONDITION": C.FAILED_PRECONDITION,
    "FEATURE_UNAVAILABLE": C.FAILED_PRECONDITION,
    "SESSION_BUSY": C.ABORTED,
    "ENGINE_UNAVAILABLE": C.UNAVAILABLE,
    "UNAUTHENTICATED": C.UNAUTHENTICATED,
}
RETRYABLE = frozenset({C.RESOURCE_EXHAUSTED, C.ABORTED, C.UNAVAILABLE})  # they carry a RetryInfo
# Codes a client may see without details: its own deadline or cancel, gRPC's message-size limit,
# no connection (or a server that stopped taking calls while it drains).
TRANSPORT = frozenset({C.DEADLINE_EXCEEDED, C.CANCELLED, C.RESOURCE_EXHAUSTED, C.UNAVAILABLE})
NEVER = frozenset({C.UNKNOWN, C.INTERNAL})  # never acceptable in this battery
CANCELLED_BY_CLIENT = "CANCELLED_BY_CLIENT"  # `Outcome.code` of a call this client cancelled itself
BUSY_RETRY_S = 0.1  # the RetryInfo delay of ABORTED (SESSION_BUSY)
BUSY_PATIENCE_S = 60.0  # how long a client keeps retrying a busy session after interrupting a call


@dataclass(frozen=True)
class Outcome:
    """How one call ended, as its client saw it."""

    code: str  # grpc.StatusCode name ("OK", "NOT_FOUND", ...), or CANCELLED_BY_CLIENT
    message: str = ""  # the status message
    reason: str = ""  # ErrorInfo.reason ("" without one)
    domain: str = ""  # ErrorInfo.domain
    fields: tuple[str, ...] = ()  # BadRequest field violations
    has_retry_info: bool = False  # a RetryInfo was attached

    @property
    def is_ok(self) -> bool:
        """The call succeeded."""
        return self.code == "OK"

    def __str__(self) -> str:
        extra = f" [{self.reason}{' ' + ','.join(self.fields) if self.fields else ''}]" if self.reason else ""
        return f"{self.code}{extra} {self.message[:160]!r}" if self.message else f"{self.code}{extra}"


OK = Outcome("OK")
CANCELLED = Outcome(CANCELLED_BY_CLIENT)


def _status(err: grpc.RpcError) -> status_pb2.Status | None:
    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status()
            status.ParseFromString(value)
            return status
    return None


def outcome_of(err: BaseException) -> Outcome:
    """The Outcome of a call that raised `err` (an RpcError, or asyncio.CancelledError for a client cancel).

    Raises:
        TypeError: `err` is neither.
    """
    if isinstance(err, asyncio.CancelledError):
        return CANCELLED
    if not isinstance(err, grpc.RpcError):
        raise TypeError(f"not a call's error: {type(err).__name__}: {err}")
    code, message = err.code(), err.details() or ""
    status = _status(err)
    reason = domain = ""
    fields: list[str] = []
    retry = False
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain = info.reason, info.domain
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = True
    return Outcome(code.name, message, reason, domain, tuple(fields), retry)


def typing_problem(o: Outcome) -> str:
    """Why `o` breaks the error contract; "" when it is a well-typed outcome."""
    if o.is_ok or o.code == CANCELLED_BY_CLIENT:
        return ""
    code = C[o.code]
    if code in NEVER:
        return f"{o.code} is never a valid answer: {o.message[:200]!r}"
    if not o.reason:
        return "" if code in TRANSPORT else f"{o.code} without an ErrorInfo (untyped error): {o.message[:200]!r}"
    if o.domain != DOMAIN:
        return f"ErrorInfo.domain {o.domain!r}, expected {DOMAIN!r}"
    if REASON_CODES.get(o.reason) != code:
        return f"reason {o.reason!r} does not belong to {o.code}"
    if o.has_retry_info != (code in RETRYABLE):
        return f"{o.code} {'has' if o.has_retry_info else 'lacks'} a RetryInfo"
    if not o.message:
        return f"{o.code} with an empty message"
    return ""


async def call_outcome(call: object) -> tuple[Outcome, object]:
    """Await a unary call (or coroutine); returns (Outcome, response or None)."""
    try:
        return OK, await call  # type: ignore[misc]
    except (grpc.RpcError, asyncio.CancelledError) as err:
        if isinstance(err, asyncio.CancelledError) and asyncio.current_task().cancelling():
            raise  # our own task is being cancelled, not the call
        return outcome_of(err), None


async def patient_outcome(make_call: Callable[[], object], patience_s: float = BUSY_PATIENCE_S) -> tuple[Outcome, object, int]:
    """As `call_outcome`, retrying ABORTED (the session still busy) after its RetryInfo delay, as a client should.

    A call right after one the client interrupted may find the server still ending that one
    (cancellation lands at the end of the running step).

    Returns:
        (Outcome, response or None, how many ABORTED answers were retried).
    """
    retried, give_up = 0, time.monotonic() + patience_s
    while True:
        got, reply = await call_outcome(make_call())
        if got.code != "ABORTED" or time.monotonic() > give_up:
            return got, reply, retried
        retried += 1
        await asyncio.sleep(BUSY_RETRY_S)


def sync_outcome(fn: object) -> tuple[Outcome, object]:
    """Run a blocking call `fn()`; returns (Outcome, response or None)."""
    try:
        return OK, fn()  # type: ignore[operator]
    except grpc.RpcError as err:
        return outcome_of(err), None
