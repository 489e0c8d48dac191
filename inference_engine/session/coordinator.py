"""SessionCoordinator (the design's AppendTokensCoordinator): the only writer of a session's state.

One per session, alive as long as it. Every token enters the same way: a block is forwarded
(`forward_block`, alone or batched with other sessions' blocks by the scheduler) and its
accepted prefix committed (`commit_or_truncate`), which extends the session's token log.
An append is a block accepted whole; a generation step is a block whose longest correct
prefix is accepted. INV-1 (the log only extends) holds by construction: the log is cut back
only for work no client ever saw succeed (`retract`, `restore`). INV-2 (the cache's next
position == the log's length) is checked around every operation. A block that fails
commits nothing and leaves the cache where it was (or marks it for a rebuild from the log),
so the session is never left corrupted. Runs on the engine thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from inference_engine.errors import InvariantViolation
from inference_engine.execution.executor import Backend, Block
from inference_engine.execution.kv_cache import CacheGeometry, CanonicalKV
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier
from inference_engine.execution.token_log import TokenLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """Where a session stood before an operation that may be abandoned (see `restore`)."""

    length: int  # log length (== cache position) at the checkpoint
    logits: mx.array | None  # next-token logits at the checkpoint
    kv: object | None = None  # the executor's K/V snapshot (taken when more than a rollback may follow)


class SessionCoordinator:
    """Feeds tokens into one session's verifier, keeping its log and cache in step."""

    def __init__(self, backend: Backend, geometry: CacheGeometry, tag: str = "", prepared: object | None = None):
        """Open the session's executor (allocates its K/V, here or on a route).

        Args:
            backend: where the session's layers run.
            geometry: its cache geometry.
            tag: a short session tag for log lines (never the session id).
            prepared: `backend.prepare(geometry)`'s result, if it ran ahead (off the engine thread).
        Raises:
            RuntimeServiceError: the backend could not open the session.
        """
        self.backend = backend
        self.geometry = geometry
        self.tag = tag
        self.log = TokenLog()  # the session's one token log
        self.verifier = SinkWindowVerifier(backend.open(geometry, self.log, prepared), self.log)
        self._needs_rebuild = False  # the cache was left undefined by a failed operation

    @property
    def position(self) -> int:
        """Tokens committed (== len(log) between operations)."""
        return len(self.log)

    # -- staged operations (the scheduler batches blocks of many sessions) -------------

    def begin(self, tokens: list[int], all_logits: bool) -> Block:
        """Stage a block at the session's next positions for a backend forward.

        Raises:
            InvariantViolation: INV-2 does not hold.
            RuntimeServiceError: the cache needed a rebuild and it failed.
        """
        self.ensure_ready()
        return self.verifier.begin_block(tokens, all_logits)

    def ensure_ready(self) -> None:
        """Rebuild the cache if a failure left it undefined, then check INV-2.

        Raises:
            InvariantViolation: INV-2 does not hold.
            RuntimeServiceError or any compute error: the rebuild failed (retried next time).
        """
        if self._needs_rebuild or self.verifier.executor.is_broken:
            self.rebuild()
        self.check_invariants()

    def state_digest(self) -> str:
        """The session's exactness digest (see SinkWindowVerifier.state_digest)."""
        self.ensure_ready()
        return self.verifier.state_digest()

    def end(self, result: mx.array | BaseException) -> mx.array:
        """Record a staged block's result.

        Raises:
            the block's error: nothing was committed; the cache is back where it was (or
            rebuilt from the log at the next call).
        """
        if isinstance(result, BaseException):
            log.warning("session %s: block failed (%s: %s); nothing committed", self.tag, type(result).__name__, result)
            self.verifier.end_block(None)
            if self.verifier.executor.is_broken:
                self._needs_rebuild = True
                try:
                    self.rebuild()
                except Exception:  # noqa: BLE001 - retried at the next call; the block's error is what the caller sees
                    log.exception("session %s: rebuilding the cache failed; retrying at its next call", self.tag)
            raise result
        return self.verifier.end_block(result)

    def accept(self, block: list[int], accepted: int) -> None:
        """Commit the first `accepted` tokens of the verified block to cache and log."""
        self.verifier.commit_or_truncate(forwarded=len(block), accepted=accepted)
        self.check_invariants()

    # -- abandoning work no client saw succeed --------------------------------------------

    def checkpoint(self, tokens_to_come: int = 0) -> Checkpoint:
        """Remember the current state, for `restore`.

        Args:
            tokens_to_come: how many tokens may be committed before a restore; beyond the
                rollback room the K/V is snapshotted (else a restore replays the whole log).
        """
        deep = tokens_to_come > self.geometry.max_rollback and len(self.log) > 0  # an empty session rebuilds for free
        kv = self.verifier.executor.snapshot() if deep else None
        return Checkpoint(len(self.log), self.verifier.next_token_logits, kv)

    def retract(self, n: int, logits: mx.array | None) -> None:
        """Undo the last generation step's `n` tokens, which were never sent to anyone.

        Args:
            n: tokens committed by that step (at most the geometry's rollback room).
            logits: next-token logits from before the step.
        """
        self.verifier.rollback(n, logits)
        self.check_invariants()

    def restore(self, mark: Checkpoint) -> None:
        """Return to `mark`, dropping everything committed since (an abandoned call).

        Within the rollback room this is a trim; beyond it (a long append that wrapped
        the window) the K/V snapshot is put back, or without one the cache is rebuilt from
        the log cut back to the mark.
        """
        n = len(self.log) - mark.length
        if n <= 0:
            return
        if n <= self.geometry.max_rollback and not self._needs_rebuild:
            self.retract(n, mark.logits)
            return
        self.log.truncate(mark.length)
        if mark.kv is not None:
            self.verifier.executor.restore(mark.kv)
            self.verifier.reset(mark.logits)
            self._needs_rebuild = False
            self.check_invariants()
            return
        self._needs_rebuild = True
        self.rebuild()

    # -- invariants and recovery ----------------------------------------------------------

    def check_invariants(self) -> None:
        """INV-2: the cache has advanced exactly as far as the log.

        Raises:
            InvariantViolation: with both numbers in the message.
        """
        pos = self.verifier.next_global_position
        if pos != len(self.log):
            raise InvariantViolation(f"session {self.tag}: next_global_position {pos} != history length {len(self.log)}")

    def rebuild(self) -> None:
        """Replace the cache with one recomputed from the log (exact replay: chunking does not matter).

        Raises:
            RuntimeServiceError or any compute error: the cache is still undefined (retried at the next call).
        """
        tokens = list(self.log)
        self.verifier.executor.close()
        self.log.truncate(0)  # the replay extends it again
        self.verifier = SinkWindowVerifier(self.backend.open(self.geometry, self.log), self.log)
        try:
            if tokens:
                self.verifier.prefill(tokens)
        except BaseException:
            self.log.truncate(0)
            self.log.extend(tokens)  # the log is the session: it never loses a token
            raise
        self._needs_rebuild = False

    def close(self) -> None:
        """Free the session's K/V (here or on the route)."""
        self.verifier.executor.close()

    # -- snapshots: the whole state out, and back into a new session ---------------------

    def export_state(self) -> tuple[list[int], np.ndarray | None, CanonicalKV]:
        """A copy of the session's state at a clean point: its log, (V,) next-token logits and canonical K/V.

        Plain numpy (MLX arrays belong to the engine thread's stream): safe to hand to any thread.

        Raises:
            InvariantViolation: INV-2 does not hold (a block is pending).
            RuntimeServiceError or any compute error: a needed rebuild failed.
        """
        self.ensure_ready()
        logits = self.verifier.next_token_logits
        return list(self.log), None if logits is None else np.array(logits), self.verifier.executor.canonical_kv()

    @classmethod
    def from_state(cls, backend: Backend, geometry: CacheGeometry, tokens: list[int], logits: np.ndarray | None,
                   kv: CanonicalKV, tag: str = "", prepared: object | None = None) -> "SessionCoordinator":
        """A new session standing exactly where `export_state` was taken (its K/V loaded, nothing recomputed).

        Raises:
            InvariantViolation: `kv` does not fit (positions, geometry or model); nothing is left allocated.
            RuntimeServiceError: the backend could not open or load it; nothing is left allocated.
        """
        coordinator = cls(backend, geometry, tag, prepared)
        try:
            if kv.position != len(tokens) or (logits is None) != (not tokens):
                raise InvariantViolation(f"a state of {len(tokens)} tokens with K/V at position {kv.position} "
                                         f"and {'no ' if logits is None else ''}logits is not a session's state")
            coordinator.log.extend(tokens)
            coordinator.verifier.executor.load_canonical_kv(kv)
            coordinator.verifier.reset(None if logits is None else mx.array(logits))
            coordinator.check_invariants()
        except BaseException:
            coordinator.close()
            raise
        return coordinator
