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

Fallback forks. A reply longer than --max-rollback cannot be rolled back, so a next turn whose
rendering of it differs (re-tokenized, or edited by the client) near its start would find no
usable entry. For such requests the service also keeps a bitwise fork of the session taken at
the end of the prompt (`ForkSession`'s path, fallback_fork.py): an entry whose history is the
prompt alone, which serves the next turn's prompt up to the reply. A fork is taken only when `has_room_for_fork`
says the pool has room for it beside the live sessions with a slab to spare (never with the
cache off, never in a pool live sessions fill), and it is discarded when the reply turns out
short enough for the full session's rollback to serve the same prefix. Forks are ordinary
entries: counted in --prefix-cache-bytes and evicted in the same LRU order, a request's fork just
before its full session (`keep(..., before=)`: the fork may be built after the reply ended, which
does not wait for it; the identity's next request does, `settled`). LRU rather than
"forks first": a request's fork goes before its full session; what LRU adds is that the
newest turn's fork outlives an older turn's full session, which a conversation that has moved
on no longer extends (forks-first would evict the one fallback the next turn may need).

The index is a scan of the identity's entries (each a longest-common-prefix over numpy
arrays): entries are few (bounded by bytes, each a whole KV slab) and the scan is linear
in the prompt, like a radix walk would be.
"""

from __future__ import annotations

import asyncio
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
SETTLE_TIMEOUT_S = 30.0  # longest a lookup waits for its identity's fork builds (a hung one; one takes 0.2-0.5 s here)


@dataclass(frozen=True)
class CacheHit:
    """A kept session taken for a new prompt."""

    session_id: str  # the session, now the caller's to use (and to give back or close)
    reused: int  # prompt tokens already in it after the rollback (the request's cached_tokens)
    rollback: int  # tokens to drop from its end first (0..max_rollback)
    is_fork: bool = False  # a fallback fork taken at the end of an earlier prompt (not a full session)


@dataclass(frozen=True)
class _Entry:
    """What the cache knows of one kept session besides its id."""

    owner: str  # its identity (only that identity's prompts are matched against it)
    is_fork: bool  # a fallback fork of a prompt (True) or a finished request's session (False)


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
        self._kept: OrderedDict[str, _Entry] = OrderedDict()  # by session id, least recently used first
        self._building: dict[str, set[asyncio.Future]] = {}  # finished requests' forks being built, by identity
        self._forks: set[asyncio.Future] = set()  # every fork being built (shutdown waits for them all)
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

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._kept

    def forks(self) -> int:
        """Kept fallback forks."""
        return sum(e.is_fork for e in self._kept.values())

    def _sessions(self) -> Iterator[Session]:
        for sid, entry in list(self._kept.items()):
            try:
                yield self.store.get(sid, entry.owner)
            except SessionNotFound:  # expired meanwhile (TTL)
                self._kept.pop(sid, None)

    def has_room_for_fork(self, session: Session, others: int = 0) -> bool:
        """Whether a fallback fork of `session` may be taken now.

        The cache must be on and hold the fork beside `session` within --prefix-cache-bytes. The
        pool, kept entries aside (they are evicted for it, least recently used first, as for any
        keep), must have a slab for the fork, one for each of `others` sessions the request is about
        to build (the forks of n > 1) and one more left free for a live session, and likewise the
        bytes under --max-kv-bytes: a fallback never takes a slab or bytes live sessions hold or
        could need (once kept it is evicted like any entry; the spare slab covers its building).
        """
        if not self.is_enabled or 2 * session.kv_bytes > self.max_bytes:
            return False
        store, needed, kept_bytes = self.store, others + 2, self.kept_bytes()  # kept_bytes() drops expired entries
        if store.slabs_in_use - len(self._kept) + needed > store.max_sessions:
            return False
        live_bytes = store.kv_bytes_in_use() - kept_bytes
        return not store.max_kv_bytes or live_bytes + needed * session.kv_bytes <= store.max_kv_bytes

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
            is_fork = self._kept[session.session_id].is_fork
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
                best = CacheHit(session.session_id, reused, rollback, is_fork)
        if best is None:
            metrics.PREFIX_CACHE_LOOKUPS.labels("miss").inc()
            return None
        del self._kept[best.session_id]
        metrics.PREFIX_CACHE_LOOKUPS.labels("fork" if best.is_fork else "hit").inc()
        metrics.PREFIX_CACHE_TOKENS.inc(best.reused)
        return best

    def fork_started(self, fork: asyncio.Future[object]) -> None:
        """A fork is being built: shutdown (`forks_built`) waits until it is kept or closed."""
        self._forks.add(fork)
        fork.add_done_callback(self._forks.discard)

    async def forks_built(self, timeout_s: float) -> None:
        """Wait at most `timeout_s` until every fork being built is kept or closed (shutdown, before `clear`:
        a fork built while draining is closed, so none outlives the cache or reaches the engine after it)."""
        if self._forks:
            await asyncio.wait(list(self._forks), timeout=timeout_s)

    def track_fork(self, owner: str, fork: asyncio.Future[object]) -> None:
        """Hold `owner`'s next lookups (`settled`) until `fork`, a finished request's fork still being
        built, is kept or closed: the identity's next turn is the one it may serve.

        Only a request that ended calls it (`FallbackFork.finish`): the forks of requests still decoding
        hold nobody, since no client sends the turn after a reply it has not yet seen.
        """
        pending = self._building.setdefault(owner, set())
        pending.add(fork)

        def built(_: asyncio.Future[object]) -> None:
            pending.discard(fork)
            if not pending and self._building.get(owner) is pending:
                del self._building[owner]

        fork.add_done_callback(built)

    async def settled(self, owner: str) -> None:
        """Wait until `owner`'s tracked forks are kept or dropped, at most SETTLE_TIMEOUT_S: a fork that takes
        longer is not waited for (the lookup goes on without it; the fork still joins the cache when
        built). Other identities never wait.
        """
        pending = self._building.get(owner)
        if pending:
            await asyncio.wait(list(pending), timeout=SETTLE_TIMEOUT_S)

    def keep(self, session_id: str, owner: str, is_fork: bool = False, before: str | None = None) -> bool:
        """Keep a finished request's session, or a fallback fork (most recently used, or just older than the
        kept session `before`: its request's full session); False if it was closed instead.

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
        self._kept[session_id] = _Entry(owner, is_fork)
        if before in self._kept and before != session_id:  # the fork just older than `before`, and only it:
            keys = list(self._kept)
            for key in keys[keys.index(before):-1]:  # `before` and the entries newer than it keep their order
                self._kept.move_to_end(key)
        while self.kept_bytes() > self.max_bytes and self.evict_one():
            pass
        return session_id in self._kept

    def discard(self, session_id: str) -> bool:
        """Close a kept session that is no longer worth its bytes (a fork its full session covers);
        whether it was still kept (not taken meanwhile)."""
        entry = self._kept.pop(session_id, None)
        if entry is None:
            return False
        self._close(session_id, entry.owner)
        return True

    def evict_one(self) -> bool:
        """Close the least recently used idle kept session; whether one was closed."""
        for sid, entry in list(self._kept.items()):
            owner = entry.owner
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
            sid, entry = self._kept.popitem()
            self._close(sid, entry.owner)
