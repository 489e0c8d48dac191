"""What one RPC did, for its log line and metrics: filled by the servicer, read by the observer.

The RPC observer starts a record in the call's context; the servicer, which knows the
session, the identity and the tokens, fills it in. Outside an observed call the record
is a throwaway, so the servicer never needs to know whether it is observed.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class CallRecord:
    """Facts about one RPC (mutable while the call runs)."""

    method: str  # e.g. AppendTokens
    session_id: str = ""  # full id: only ever logged through short_id
    identity: str = ""  # the caller's identity: only ever logged through short_id
    tokens_in: int | None = None  # tokens the call appended (None: not a token-carrying call)
    tokens_out: int | None = None  # tokens the call streamed
    stop_reason: str = ""  # how a Generate ended


_CURRENT: ContextVar[CallRecord | None] = ContextVar("call_record", default=None)


def begin(method: str) -> CallRecord:
    """Start the record of the current call (each grpc.aio call runs in its own task and context)."""
    record = CallRecord(method)
    _CURRENT.set(record)
    return record


def current() -> CallRecord:
    """The current call's record (a throwaway outside an observed call)."""
    return _CURRENT.get() or CallRecord("")
