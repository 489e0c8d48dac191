"""The sink-window verifier: a session's model state on the exact forward path.

`forward_block` computes a block of tokens into the cache (tentatively) and returns their
logits; `commit_or_truncate` keeps the accepted prefix, appends it to the session's token
log, and drops the rest, which is exact even after the window has wrapped because dropped
rows only ever overwrote ring slots that no retained position needs (see kv_cache.py).
The verifier keeps no tokens of its own: the cached token sequence is the log read at the
positions the next query sees.

A block can also be computed with other sessions' blocks in one backend forward:
`begin_block` stages it, the caller runs `Backend.forward`, `end_block` records the result.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np

from inference_engine.errors import InvariantViolation
from inference_engine.execution.executor import Block, Executor
from inference_engine.execution.token_log import TokenLog


def state_digest(logits: mx.array | None, cached_tokens: list[int], position: int, layer_digests: list[bytes]) -> str:
    """The exactness digest a client can compare (see GetSessionInfo.state_digest)."""
    h = hashlib.sha256()
    if logits is not None:
        h.update(np.array(logits).tobytes())
    h.update(np.array(cached_tokens, dtype=np.int64).tobytes())
    h.update(np.int64(position).tobytes())
    for d in layer_digests:
        h.update(d)
    return h.hexdigest()


class SinkWindowVerifier:
    """Per-session next-token logits and pending block over an executor and the session's log."""

    def __init__(self, executor: Executor, log: TokenLog | None):
        """
        Args:
            executor: computes blocks and owns the K/V (at position len(log)).
            log: the session's token log, which the verifier extends on commit and cuts on
                rollback; None for a cache that follows a log by position (a draft model's).
        """
        self.executor = executor
        self.geometry = executor.geometry
        self.log = log
        self._logits: mx.array | None = None  # (V,) logits after the last committed token
        self._pending: tuple[tuple[int, ...], mx.array | None, bool] | None = None  # tokens, logits, all_logits

    @property
    def next_global_position(self) -> int:
        """Global position the next token will take (== committed tokens)."""
        return self.executor.offset - (len(self._pending[0]) if self._pending else 0)

    @property
    def next_token_logits(self) -> mx.array | None:
        """(V,) float32 logits predicting the next token; None before any token."""
        return self._logits

    @property
    def cached_token_sequence(self) -> list[int]:
        """Tokens whose K/V the next query attends to: sinks, then the window, in order."""
        p = self.next_global_position
        if self.log is None:
            raise InvariantViolation("this cache keeps no token log (a draft cache)")
        return [self.log[q] for q in self.geometry.visible_positions(p)[:-1]] if p else []

    def prefill(self, tokens: list[int]) -> None:
        """Feed tokens and commit them all (the first append of a session)."""
        self.forward_block(tokens, all_logits=False)
        self.commit_or_truncate(len(tokens), len(tokens))

    def begin_block(self, tokens: list[int] | tuple[int, ...], all_logits: bool = True) -> Block:
        """Stage a block for a backend forward (then `end_block` with its result).

        Raises:
            InvariantViolation: a previous block is still pending, or the block is empty.
        """
        if self._pending is not None:
            raise InvariantViolation("forward_block called while a previous block awaits commit_or_truncate")
        if not tokens:
            raise InvariantViolation("forward_block needs at least one token")
        block = Block(self.executor, tuple(int(t) for t in tokens), all_logits)
        self._pending = (block.tokens, None, all_logits)
        return block

    def end_block(self, logits: mx.array | BaseException | None) -> mx.array | None:
        """Record the staged block's result (pending a commit); None drops it (it failed).

        Raises:
            the block's exception (the block is dropped; see Backend.forward for the K/V).
        """
        assert self._pending is not None, "end_block without begin_block"
        if logits is None or isinstance(logits, BaseException):
            self._pending = None
            if logits is not None:
                raise logits
            return None
        tokens, _, all_logits = self._pending
        self._pending = (tokens, logits, all_logits)
        return logits

    def forward_block(self, tokens: list[int], all_logits: bool = True, wait: bool = True) -> mx.array:
        """Compute `tokens` at the next positions into the cache, pending a commit.

        Args:
            tokens: the block (non-empty).
            all_logits: return logits of every row (verification), else the last row's.
            wait: False may return the logits while they are still computing (see
                Backend.forward); bits are the same either way.
        Returns:
            (L, V) float32 logits (or (1, V)); row i predicts the token after tokens[i].
        Raises:
            InvariantViolation: a previous block is still pending.
        """
        block = self.begin_block(tokens, all_logits)
        return self.end_block(self.executor.backend.forward([block], wait)[0])

    def commit_or_truncate(self, forwarded: int, accepted: int) -> None:
        """Keep the first `accepted` of the `forwarded` pending tokens, drop the rest.

        Raises:
            InvariantViolation: counts do not match the pending block, or more than
                `max_rollback` tokens would be dropped.
        """
        if self._pending is None or self._pending[1] is None or forwarded != len(self._pending[0]):
            have = len(self._pending[0]) if self._pending else 0
            raise InvariantViolation(f"commit_or_truncate(forwarded={forwarded}) but {have} tokens are pending")
        drop = forwarded - accepted
        if accepted < 0 or drop < 0 or drop > self.geometry.max_rollback:
            raise InvariantViolation(
                f"accepted={accepted} must be in [{max(0, forwarded - self.geometry.max_rollback)}, {forwarded}]"
            )
        tokens, logits, all_logits = self._pending
        if not all_logits and accepted != forwarded:
            raise InvariantViolation("a block forwarded with last-row logits only must be accepted whole")
        self.executor.trim(drop)
        self._pending = None
        if self.log is not None:
            self.log.extend(tokens[:accepted])
        if accepted:
            self._logits = logits[accepted - 1] if all_logits else logits[-1]

    def rollback(self, n: int, logits: mx.array | None = None) -> None:
        """Drop the last `n` committed tokens (at most `max_rollback`) from the cache and the log.

        Args:
            n: tokens to drop.
            logits: the next-token logits after the remaining tokens, if the caller kept
                them; otherwise `next_token_logits` is None until a token is fed.
        Raises:
            InvariantViolation: a block is pending or n is out of range.
        """
        if self._pending is not None:
            raise InvariantViolation("rollback while a block awaits commit_or_truncate")
        if n < 0 or n > min(self.geometry.max_rollback, self.next_global_position):
            raise InvariantViolation(f"cannot roll back {n} tokens (allowed 0..{self.geometry.max_rollback})")
        self.executor.trim(n)
        if self.log is not None:
            self.log.truncate(len(self.log) - n)
        self._logits = logits

    def reset(self, logits: mx.array | None) -> None:
        """Drop any pending block and set the next-token logits (after the executor was restored)."""
        self._pending = None
        self._logits = logits

    def state_digest(self) -> str:
        """Hex SHA-256 over next-token logits, cached tokens, position and cached K/V.

        K/V enter as one SHA-256 per layer (in layer order), so a layer split across shard
        workers yields the same digest as one process.
        """
        return state_digest(self._logits, self.cached_token_sequence, self.next_global_position,
                            self.executor.layer_digests())

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage held by this session (bounded by the geometry)."""
        return self.executor.nbytes
