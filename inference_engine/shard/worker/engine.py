"""The ShardEngine contract: what a worker's compute must do, whoever implements it.

Two implementations: `MlxShardEngine` (real layers on MLX) and `FaultInjectingEngine`
(a test fixture wrapping another engine). `tests/shard_contract.py` checks both.

Threading: prefill, decode, step_many, trim, layer_digests, export_kv, import_kv, open_session and release run on one
engine thread;
`cancel`, `health`, `metrics` and `capabilities` may be called from any thread while work runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from inference_engine.shard.protocol.types import ShardCapabilities, ShardHealth, ShardMetrics, ShardOutput, ShardWork
from inference_engine.shard.protocol.types import StepItem  # a queued block of one session (step_many)
from inference_engine.execution.kv_cache import CacheGeometry


class ShardEngine(ABC):
    """Computes layers [start, end) of one model for many route sessions."""

    @abstractmethod
    def load(self) -> None:
        """Load weights and fix the tile; idempotent. Must precede every other call.

        Raises:
            ValueError: the layer range does not fit the model.
            InvariantViolation: no block size is bit-exact on this BLAS.
        """

    @abstractmethod
    def capabilities(self) -> ShardCapabilities:
        """Layer range, sizes and limits (constant after `load`)."""

    @abstractmethod
    def open_session(self, session_id: str, geometry: CacheGeometry) -> None:
        """Allocate a session's caches for this engine's layers, at position 0.

        Raises:
            InvalidRequest: the id is in use, or the geometry exceeds the capabilities.
            PoolExhausted: no room for another session.
            EngineUnavailable: the engine is gone.
        """

    @abstractmethod
    def prefill(self, session_id: str, work: ShardWork) -> ShardOutput:
        """Compute a block of rows at the session's next positions and keep them in the cache.

        Rows run in chunks of the session's `max_block`, exactly as `forward.forward` does,
        so a route of engines reproduces the single-process result bit for bit.

        Returns:
            (rows, hidden) activations; the tail returns (rows, vocab) logits if
            `work.all_logits`, else (1, vocab) for the last row.
        Raises:
            SessionNotFound: unknown session.
            InvalidRequest: the input does not fit this engine (tokens at the head, hidden
                of width hidden_size elsewhere, token ids below vocab_size, rows >= 1).
            InvariantViolation: `work.position` is not the session's position, or the
                session is broken (an earlier failure left its cache unusable).
            WorkCancelled: the item or the session was cancelled; the cache is as before.
            EngineUnavailable: the engine is gone.
        """

    @abstractmethod
    def decode(self, session_id: str, work: ShardWork) -> ShardOutput:
        """`prefill` for exactly one row (the same forward path).

        Raises:
            InvalidRequest: `work` has more than one row; otherwise as `prefill`.
        """

    def step_many(self, items: Sequence[StepItem]) -> list[ShardOutput | BaseException]:
        """The blocks of several sessions, each as `decode` / `prefill` would compute it.

        An engine may run them in one forward (each row's bits are its session's alone); this
        default runs them one by one, in order. Items of one session run in their order.

        Returns:
            Per item, its output or the exception `decode` / `prefill` would have raised for it
            (one item's failure never stops the others).
        """
        results: list[ShardOutput | BaseException] = []
        for item in items:
            try:
                fn = self.decode if item.is_decode else self.prefill
                results.append(fn(item.session_id, item.work))
            except Exception as exc:  # noqa: BLE001 - handed to that item's caller
                results.append(exc)
        return results

    @abstractmethod
    def trim(self, session_id: str, n: int, position: int) -> int:
        """Drop the session's last n positions (speculative rollback); returns the new position.

        Raises:
            SessionNotFound: unknown session.
            InvariantViolation: `position` is not the session's, or n exceeds max_rollback
                or the position.
        """

    @abstractmethod
    def layer_digests(self, session_id: str, position: int) -> list[bytes]:
        """SHA-256 of each block's cached K/V (`SinkWindowKVCache.digest`), in layer order.

        A route's digests, head first, equal a single process's over the same tokens.

        Raises:
            SessionNotFound: unknown session.
            InvariantViolation: `position` is not the session's.
        """

    @abstractmethod
    def export_kv(self, session_id: str, position: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """A copy of each block's retained K/V (`SinkWindowKVCache.canonical_state`), in layer order.

        Returns:
            Per block (keys, values), (n_kv, n, head_dim) each: what `layer_digests` hashes.
        Raises:
            SessionNotFound: unknown session.
            InvariantViolation: `position` is not the session's.
        """

    @abstractmethod
    def import_kv(self, session_id: str, position: int, target: int,
                  layers: list[tuple[np.ndarray, np.ndarray]]) -> int:
        """Load retained K/V (as `export_kv` returns it) into a fresh session; returns its new position `target`.

        Raises:
            SessionNotFound: unknown session.
            InvariantViolation: `position` is not the session's, or the session is not at 0.
            InvalidRequest: the tensors do not fit this engine's blocks at `target` (count, shape, dtype).
        """

    @abstractmethod
    def cancel(self, session_id: str, work_id: int | None = None) -> bool:
        """Cancel one work item (running now or started later) or, with None, the session.

        A cancelled item stops at its next chunk boundary with WorkCancelled; a cancelled
        session refuses all further work. Thread-safe; never blocks on running work.

        Returns:
            Whether the session exists.
        """

    @abstractmethod
    def release(self, session_id: str) -> bool:
        """Free the session's caches. Returns whether it existed."""

    @abstractmethod
    def health(self) -> ShardHealth:
        """Whether work is accepted (cheap, thread-safe)."""

    @abstractmethod
    def metrics(self) -> ShardMetrics:
        """Counters since start (thread-safe)."""
