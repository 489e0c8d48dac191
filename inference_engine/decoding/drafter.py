"""Drafters propose the tokens the target is likely to produce next.

Two real implementations: a draft model (a smaller or quantized model sharing the
tokenizer, with its own sink-window cache per session that follows the session's token log
by position) and prompt lookup (copies the continuation of the latest n-gram match in the
session's own log; no model). Proposals only affect speed: the target verifies every token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import mlx.core as mx

from inference_engine.session.session import DraftCache, Session
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier


class Drafter(ABC):
    """Proposer of draft tokens (one per server; per-session state lives in the Session)."""

    @abstractmethod
    def propose(self, session: Session, next_token: int, k: int) -> list[int]:
        """Propose up to `k` tokens to follow the session's log and then `next_token`.

        Args:
            session: whose log (and draft cache, if any) to use; runs on the engine thread.
            next_token: the target's own next token (always committed first).
            k: most tokens to propose (>= 1).
        Returns:
            0..k proposed tokens; fewer (or none) when the drafter has no good guess.
        """


class PromptLookupDrafter(Drafter):
    """Copy what followed the latest earlier occurrence of the context's last n-gram."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, search_window: int = 8192):
        # Single-token matches are mostly noise in free text: each wrong draft costs a
        # verification row, so they are not proposed by default (the server proposes them
        # where that row is nearly free: runtime/verify_row_cost.py).
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.search_window = search_window

    def propose(self, session: Session, next_token: int, k: int) -> list[int]:
        """Longest suffix n-gram (n = max_ngram..min_ngram) matched most recently wins."""
        tail = session.history.tail(self.search_window - 1) + [next_token]
        for n in range(min(self.max_ngram, len(tail) - 1), self.min_ngram - 1, -1):
            suffix = tail[-n:]
            for j in range(len(tail) - n - 1, -1, -1):
                if tail[j : j + n] == suffix:
                    return tail[j + n : j + n + k]
        return []


class ModelDrafter(Drafter):
    """Greedy tokens of a draft model whose per-session cache follows the log lazily.

    The draft cache holds the first `length` log tokens plus the tokens of its last
    proposal (`drafted`, starting with the target's token of that step); at each call it
    keeps what still matches the log, rolls back the rest (at most K) and computes only
    the tokens it has not seen.
    """

    def __init__(self, make_cache: Callable[[Session], SinkWindowVerifier], catch_up: int = 16):
        """
        Args:
            make_cache: a fresh draft-model cache for a session (same geometry, no token log).
            catch_up: most log tokens one call computes into the draft cache. Further behind (a
                long history on first use), the cache catches up that many per step and proposes
                nothing until level: one step never holds the engine thread for a whole prefill.
        """
        if catch_up < 1:
            raise ValueError(f"catch_up must be at least 1 token, not {catch_up}")
        self._make_cache = make_cache
        self.catch_up = catch_up

    def _cache(self, session: Session) -> DraftCache:
        if session.draft is None:
            session.draft = DraftCache(self._make_cache(session), session.history.watermark())
        return session.draft

    def _sync(self, session: Session, next_token: int) -> DraftCache | None:
        """Make the draft cache hold exactly log + [next_token] except its last token, with logits after it.

        Returns None when it is more than `catch_up` tokens behind: it took one chunk of the log.
        """
        d, log = self._cache(session), session.history
        n = len(log)
        context_at = lambda i: log[i] if i < n else next_token  # noqa: E731 - context = log + [next_token]
        held = d.length + len(d.drafted)  # == the draft cache's position
        common = min(d.followed.valid, d.length, n)
        if common == d.length:
            for i, t in enumerate(d.drafted):
                if d.length + i > n or context_at(d.length + i) != t:
                    break
                common += 1
        room = d.verifier.geometry.max_rollback
        if held - common > room:
            d = session.draft = DraftCache(self._make_cache(session), log.watermark())  # too far apart: rebuild
            held = common = 0
        if common == n + 1:  # need the logits after the last context token: recompute it
            common -= 1
        if held > common:
            d.verifier.rollback(held - common)
        todo = [context_at(i) for i in range(common, n + 1)]
        if len(todo) > self.catch_up:  # far behind: one chunk of the log now, the rest at the next steps
            d.verifier.forward_block(todo[: self.catch_up], all_logits=False)
            d.verifier.commit_or_truncate(self.catch_up, self.catch_up)
            d.length, d.drafted = common + self.catch_up, []
            d.followed.valid = d.length
            return None
        d.verifier.forward_block(todo, all_logits=False)
        d.verifier.commit_or_truncate(len(todo), len(todo))
        d.length, d.drafted = n, [next_token]
        d.followed.valid = n
        return d

    def propose(self, session: Session, next_token: int, k: int) -> list[int]:
        """k greedy tokens of the draft model after the log and `next_token`."""
        d = self._sync(session, next_token)
        if d is None:
            return []
        out: list[int] = []
        for i in range(k):
            token = int(mx.argmax(d.verifier.next_token_logits).item())
            out.append(token)
            if i < k - 1:
                d.verifier.forward_block([token], all_logits=False)
                d.verifier.commit_or_truncate(1, 1)
                d.drafted.append(token)
        return out
