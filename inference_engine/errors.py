"""One error hierarchy for the runtime; the servicer maps each class to one gRPC code."""

from __future__ import annotations


class RuntimeServiceError(Exception):
    """Base of every error the runtime raises on purpose."""


class InvalidRequest(RuntimeServiceError):
    """A request field is out of bounds (INVALID_ARGUMENT)."""

    def __init__(self, message: str, field: str = ""):
        """
        Args:
            message: what was wrong and what is allowed.
            field: path of the offending request field (`tokens[3]`), "" when not one field.
        """
        super().__init__(message)
        self.field = field


class MalformedRequest(InvalidRequest):
    """The request bytes do not decode as the method's message (INVALID_ARGUMENT)."""


class RequestTooLarge(InvalidRequest):
    """A request body is over the server's byte bound (INVALID_ARGUMENT; HTTP 413)."""


class SnapshotCorrupt(InvalidRequest):
    """A session snapshot is truncated, corrupted (checksum) or not a snapshot at all (INVALID_ARGUMENT)."""


class InvalidConstraint(InvalidRequest):
    """A constraint's JSON schema, regex or grammar does not compile (INVALID_ARGUMENT; the message says where)."""


class Unauthenticated(RuntimeServiceError):
    """No bearer token, or one the server does not know (UNAUTHENTICATED)."""


class UnknownModel(RuntimeServiceError):
    """A request names a model this server does not serve (NOT_FOUND; HTTP 404)."""


class SessionNotFound(RuntimeServiceError):
    """Unknown, expired or closed session (NOT_FOUND)."""


class PoolExhausted(RuntimeServiceError):
    """Every KV slab of the pool is in use (RESOURCE_EXHAUSTED)."""


class TooManyTransfers(RuntimeServiceError):
    """As many snapshot and restore streams are open as --max-transfers (or, for this identity,
    --max-transfers-per-identity) allow (RESOURCE_EXHAUSTED: retry later)."""


class InvariantViolation(RuntimeServiceError):
    """An operation would break INV-1/INV-2 or the session's state (FAILED_PRECONDITION)."""


class SnapshotIncompatible(InvariantViolation):
    """A sound snapshot this server cannot restore exactly: another format version, model, tokenizer,
    kernels, block size, mode, or a sink/window over its limits (FAILED_PRECONDITION)."""


class SessionBusy(RuntimeServiceError):
    """Another AppendTokens/Generate is running on the session (ABORTED: retry later)."""


class EngineUnavailable(RuntimeServiceError):
    """The compute engine is gone or shutting down (UNAVAILABLE)."""


class EngineShutdown(EngineUnavailable):
    """The engine is shutting down (UNAVAILABLE; a stream it ends gets its final message, stop reason CANCELLED).

    Only this ends a stream "normally": any other EngineUnavailable (a shard route that stopped
    answering) fails it, so a client can tell a drained server from a call that failed.
    """


class TokenizerUnavailable(EngineUnavailable):
    """A tokenizer process died during a large text, or is shut down (UNAVAILABLE: retry; a new one starts)."""


class FeatureUnavailable(RuntimeServiceError):
    """The served model cannot do what was asked (no tokenizer, no chat template) (FAILED_PRECONDITION)."""
