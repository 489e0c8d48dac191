"""The exact prefix cache: finished requests' sessions, kept to serve a later prompt's prefix.

A stateless client re-sends the whole conversation each turn. After a request its session
(prompt + reply, K/V and all) is kept instead of closed; the next request of the same
identity whose tokens start with a kept session's history takes that session and appends
only the rest. A kept history that diverges from the new prompt within its last
--max-rollback tokens is rolled back to the common prefix first (a reply the chat template
re-tokenizes differently, a regenerated last turn). The K/V of a prefix is exactly what a
fresh prefill computes (the probed tile makes it independent of chunking), so the output
with the cache is bitwise the output without it.

Entries are per identity: a prompt is only ever matched against its own identity's
sessions (no cross-tenant reuse, no timing side channel). They are bounded by
--prefix-cache-bytes and evicted least recently used, also whenever the session pool needs
a slab or bytes for a live session (`SessionStore.evict_kept`). A taken entry leaves the
cache (no copies: the session moves to the request) and comes back when the request ends.

The index is a scan of the identity's entries (each a longest-common-prefix over numpy
arrays): entries are few (bounded by bytes, each a whole KV slab) and the scan is linear
in the prompt, like a radix walk would be.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from inference_engine import metrics
from inference_engine.errors import SessionNotFound
from inference_engine.session.session import Session
from inference_engine.session.session_store import SessionStore
from inference_engine.short_id import short_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheHit:
    """A kept session taken for a new prompt."""

    session_id: str  # the session, now the caller's to use (and to give back or close)
    reused: int  # prompt tokens already in it after the rollback (the request's cached_tokens)
    rollback: int  # tokens to drop from its end first (0..max_rollback)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """Kept sessions by identity, least recently used first."""

    def __init__(self, store: SessionStore, max_bytes: int, max_rollback: int):
        """
        Args:
            store: the runtime's session store (kept sessions are ordinary sessions in it).
            max_bytes: K/V bytes the kept sessions may hold together (0: keep none).
            max_rollback: most tokens a kept history may be cut back to reach a common prefix.
        """
        self.store = store
        self.max_bytes = max_bytes
        self.max_rollback = max_rollback
        self._kept: OrderedDict[str, str] = OrderedDict()  # session id -> owner, least recently used first
        store.evict_kept = self.evict_one

    @property
    def is_enabled(self) -> bool:
        """Sessions are kept at all."""
        return self.max_bytes > 0

    def kept_bytes(self) -> int:
        """K/V bytes the kept sessions hold."""
        return sum(s.kv_bytes for s in self._sessions())

    def __len__(self) -> int:
        return len(self._kept)

    def _sessions(self) -> Iterator[Session]:
        for sid, owner in list(self._kept.items()):
            try:
                yield self.store.get(sid, owner)
            except SessionNotFound:  # expired meanwhile (TTL)
                self._kept.pop(sid, None)

    def take(self, owner: str, prompt: Sequence[int]) -> CacheHit | None:
        """Take `owner`'s kept session that serves the longest prefix of `prompt`, if any.

        A usable session's history is a prefix of the prompt, or differs from it only in its
        last `max_rollback` tokens; at least one prompt token is left to append when a
        rollback is needed (it brings the next-token logits back).
        """
        best: CacheHit | None = None
        for session in self._sessions():
            if session.owner != owner or session.is_busy:
                continue
            history = session.history
            n = len(history)
            common = common_prefix(history, prompt)
            if common == n and n <= len(prompt):
                reused, rollback = n, 0
            else:
                reused = min(common, len(prompt) - 1)
                rollback = n - reused
                if rollback > self.max_rollback or reused <= 0:
                    continue
            if best is None or reused > best.reused:
                best = CacheHit(session.session_id, reused, rollback)
        if best is None:
            metrics.PREFIX_CACHE_LOOKUPS.labels("miss").inc()
            return None
        del self._kept[best.session_id]
        metrics.PREFIX_CACHE_LOOKUPS.labels("hit").inc()
        metrics.PREFIX_CACHE_TOKENS.inc(best.reused)
        return best

    def keep(self, session_id: str, owner: str) -> bool:
        """Keep a finished request's session (most recently used); False if it was closed instead.

        Older entries are evicted to stay within the byte bound; a session over the bound alone
        is closed.
        """
        try:
            session = self.store.get(session_id, owner)
        except SessionNotFound:
            return False
        if session.kv_bytes > self.max_bytes:
            self._close(session_id, owner)
            return False
        self._kept[session_id] = owner
        while self.kept_bytes() > self.max_bytes and self.evict_one():
            pass
        return session_id in self._kept

    def evict_one(self) -> bool:
        """Close the least recently used idle kept session; whether one was closed."""
        for sid, owner in list(self._kept.items()):
            try:
                session = self.store.get(sid, owner)
            except SessionNotFound:
                self._kept.pop(sid, None)
                continue
            if session.is_busy:
                continue
            del self._kept[sid]
            self._close(sid, owner)
            metrics.PREFIX_CACHE_EVICTIONS.inc()
            log.debug("prefix cache: evicted session %s of %s", short_id(sid), short_id(owner))
            return True
        return False

    def _close(self, session_id: str, owner: str) -> None:
        try:
            self.store.close(session_id, owner)
        except SessionNotFound:
            pass

    def clear(self) -> None:
        """Close every kept session (shutdown)."""
        while self._kept:
            sid, owner = self._kept.popitem()
            self._close(sid, owner)
