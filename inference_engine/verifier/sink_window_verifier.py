"""The sink-window verifier: a session's model state on the exact forward path.

`forward_block` computes a block of tokens into the cache (tentatively) and returns their
logits; `commit_or_truncate` keeps the accepted prefix and drops the rest, which is exact
even after the window has wrapped because dropped rows only ever overwrote ring slots
that no retained position needs (see kv_cache.py).
"""

from __future__ import annotations

import hashlib
from collections import deque

import mlx.core as mx
import numpy as np

from inference_engine.errors import InvariantViolation
from inference_engine.verifier.executor import Executor


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
    """Per-session bookkeeping + next-token logits over an executor (local or shard route)."""

    def __init__(self, executor: Executor):
        self.executor = executor  # computes blocks and owns the K/V
        self.geometry = executor.geometry
        self._sink_tokens: list[int] = []  # tokens at positions < sink
        self._recent: deque[int] = deque(maxlen=self.geometry.ring)  # tokens at the latest positions
        self._logits: mx.array | None = None  # (V,) logits after the last committed token
        self._pending: tuple[list[int], mx.array, mx.array | None] | None = None  # tokens, logits, prior logits

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
        visible = self.geometry.visible_positions(p)[:-1] if p else []
        return [self._token_at(q, p) for q in visible]

    def _token_at(self, q: int, p: int) -> int:
        if q < self.geometry.sink:
            return self._sink_tokens[q]
        return self._recent[len(self._recent) - (p - q)]

    def prefill(self, tokens: list[int]) -> None:
        """Feed tokens and commit them all (the first append of a session)."""
        self.forward_block(tokens, all_logits=False)
        self.commit_or_truncate(len(tokens), len(tokens))

    def forward_block(self, tokens: list[int], all_logits: bool = True, wait: bool = True) -> mx.array:
        """Compute `tokens` at the next positions into the cache, pending a commit.

        Args:
            tokens: the block (non-empty).
            all_logits: return logits of every row (verification), else the last row's.
            wait: False may return the logits while they are still computing (see
                Executor.forward); bits are the same either way.
        Returns:
            (L, V) float32 logits (or (1, V)); row i predicts the token after tokens[i].
        Raises:
            InvariantViolation: a previous block is still pending.
        """
        if self._pending is not None:
            raise InvariantViolation("forward_block called while a previous block awaits commit_or_truncate")
        if not tokens:
            raise InvariantViolation("forward_block needs at least one token")
        logits = self.executor.forward(list(tokens), all_logits, wait)
        self._pending = (list(tokens), logits, self._logits)
        return logits

    def commit_or_truncate(self, forwarded: int, accepted: int) -> None:
        """Keep the first `accepted` of the `forwarded` pending tokens, drop the rest.

        Raises:
            InvariantViolation: counts do not match the pending block, or more than
                `max_rollback` tokens would be dropped.
        """
        if self._pending is None or forwarded != len(self._pending[0]):
            have = len(self._pending[0]) if self._pending else 0
            raise InvariantViolation(f"commit_or_truncate(forwarded={forwarded}) but {have} tokens are pending")
        drop = forwarded - accepted
        if accepted < 0 or drop < 0 or drop > self.geometry.max_rollback:
            raise InvariantViolation(
                f"accepted={accepted} must be in [{max(0, forwarded - self.geometry.max_rollback)}, {forwarded}]"
            )
        tokens, logits, prior = self._pending
        if logits.shape[0] != forwarded and accepted != forwarded:
            raise InvariantViolation("a block forwarded with last-row logits only must be accepted whole")
        self.executor.trim(drop)
        self._pending = None
        start = self.executor.offset - accepted
        for i, t in enumerate(tokens[:accepted]):
            (self._sink_tokens if start + i < self.geometry.sink else self._recent).append(t)
        if accepted == 0:
            self._logits = prior
        else:
            # With last-row-only logits the block was fully accepted (prefill/append).
            self._logits = logits[accepted - 1] if logits.shape[0] == forwarded else logits[-1]

    def rollback(self, n: int, logits: mx.array | None = None) -> None:
        """Drop the last `n` committed tokens (at most `max_rollback`).

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
        for i in range(n):
            p = self.executor.offset + n - 1 - i  # position being removed (descending)
            (self._sink_tokens if p < self.geometry.sink else self._recent).pop()
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
