"""AppendTokensCoordinator: the only writer of a session's history and cache.

First append prefills; later appends run forward_block + commit_or_truncate. INV-1
(history only extends) holds by construction: history is only ever extended here (the one
exception, `retract`, removes a step no client was ever sent). INV-2
(next_global_position == history length) is checked before and after every call; if
compute fails midway the cache is rebuilt from the history so the session is never left
corrupted. Runs on the engine thread.
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.core as mx

from inference_engine.errors import InvariantViolation
from inference_engine.runtime.session import Session
from inference_engine.short_id import short_id
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier

log = logging.getLogger(__name__)


class AppendTokensCoordinator:
    """Feeds tokens into one session's verifier, keeping history and cache in step."""

    def __init__(self, session: Session, make_verifier: Callable[[], SinkWindowVerifier]):
        self.session = session
        self._make_verifier = make_verifier

    def append(self, tokens: list[int]) -> None:
        """Append `tokens` to history and cache.

        Raises:
            InvariantViolation: the session's cache and history disagree (before or
                after the call); the session is rebuilt from its history when possible.
        """
        s, v = self.session, self.session.verifier
        self.check_invariants()
        try:
            if not s.history:
                v.prefill(tokens)
            else:
                v.forward_block(tokens, all_logits=False)
                v.commit_or_truncate(forwarded=len(tokens), accepted=len(tokens))
        except Exception:
            log.exception("compute failed in session %s; rebuilding its cache from history", short_id(s.session_id))
            self.rebuild()
            raise
        s.history.extend(tokens)
        self.check_invariants()

    def verify(self, block: list[int]) -> mx.array:
        """Forward a generation block (next greedy token + drafts), pending `accept`.

        The block's tokens are known, so it is committed and sent while its logits are
        still computing; the next step's read of them waits (the stream write overlaps).

        Returns:
            (L, V) logits, possibly still computing; row i predicts the token after block[i].
        """
        self.check_invariants()
        return self.session.verifier.forward_block(block, all_logits=True, wait=False)

    def accept(self, block: list[int], accepted: int) -> None:
        """Commit the first `accepted` tokens of the verified block to cache and history."""
        self.session.verifier.commit_or_truncate(forwarded=len(block), accepted=accepted)
        self.session.history.extend(block[:accepted])
        self.check_invariants()

    def retract(self, n: int, logits: mx.array | None) -> None:
        """Undo the last generation step's `n` tokens, which were never sent to anyone.

        Args:
            n: tokens committed by that step.
            logits: next-token logits from before the step.
        """
        s = self.session
        s.verifier.rollback(n, logits)
        del s.history[len(s.history) - n :]
        self.check_invariants()

    def check_invariants(self) -> None:
        """INV-2: the cache has advanced exactly as far as the history.

        Raises:
            InvariantViolation: with both numbers in the message.
        """
        s = self.session
        pos = s.verifier.next_global_position
        if pos != len(s.history):
            raise InvariantViolation(
                f"session {s.session_id}: next_global_position {pos} != history length {len(s.history)}"
            )

    def rebuild(self) -> None:
        """Replace the verifier with one recomputed from the full history (exact replay)."""
        s = self.session
        s.verifier = self._make_verifier()
        if s.history:
            s.verifier.prefill(list(s.history))
