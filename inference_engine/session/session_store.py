"""The session store: a fixed pool of KV slabs, unguessable ids and idle expiry.

A closed or expired session's K/V is freed (here or on the shard route) as soon as no call
holds it: at once, or when its running call ends.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Callable, Iterator

from inference_engine.errors import InvalidRequest, PoolExhausted, SessionNotFound
from inference_engine.security.settings import ANONYMOUS
from inference_engine.session.session import Session

log = logging.getLogger(__name__)


class SessionStore:
    """Sessions by id. A slab stays counted until its session is closed *and* idle."""

    def __init__(self, max_sessions: int, ttl_s: float, max_kv_bytes: int = 0):
        """
        Args:
            max_sessions: sessions (target slabs) at once.
            ttl_s: idle seconds before a session expires.
            max_kv_bytes: K/V bytes all sessions may hold together, draft caches included (0: no bound).
        """
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_kv_bytes = max_kv_bytes
        self._sessions: dict[str, Session] = {}
        self._draining: dict[str, Session] = {}  # closed but still busy: K/V not yet free
        self._reserved = 0  # slabs held for sessions being built (`reservation`: creates, restores, forks)
        # Observers (--persist-sessions): a session was added or a call on it ended; one was closed or expired.
        self.on_change: Callable[[Session], None] | None = None
        self.on_remove: Callable[[Session], None] | None = None
        # Frees one kept (idle, cached) session when the pool is full; True if it freed one (the HTTP prefix cache).
        self.evict_kept: Callable[[], bool] | None = None

    @staticmethod
    def new_id() -> str:
        """128 random bits, URL-safe."""
        return secrets.token_urlsafe(16)

    @property
    def slabs_in_use(self) -> int:
        """Open sessions, closed ones whose last call has not finished, and reserved slabs."""
        return len(self._sessions) + len(self._draining) + self._reserved

    def kv_bytes_in_use(self) -> int:
        """K/V bytes every session holds (target and draft slabs, closed ones still draining included)."""
        return sum(s.kv_bytes for s in (*self._sessions.values(), *self._draining.values()))

    def reserve(self, nbytes: int = 0) -> None:
        """Check a slab (and `nbytes` more K/V) fits before building it.

        Raises:
            PoolExhausted: all `max_sessions` slabs are in use, or the bytes exceed `max_kv_bytes`.
        """
        self.expire_idle()
        while self.slabs_in_use >= self.max_sessions and self._evict_kept():
            pass
        if self.slabs_in_use >= self.max_sessions:
            raise PoolExhausted(
                f"all {self.max_sessions} session slabs are in use; close a session or wait for idle ones to expire"
            )
        self.reserve_bytes(nbytes)

    def reserve_bytes(self, nbytes: int) -> None:
        """Check `nbytes` more K/V fit under `max_kv_bytes` (e.g. a draft model's cache).

        Raises:
            PoolExhausted: with the numbers.
        """
        while self.max_kv_bytes and self.kv_bytes_in_use() + nbytes > self.max_kv_bytes and self._evict_kept():
            pass
        used = self.kv_bytes_in_use()
        if self.max_kv_bytes and used + nbytes > self.max_kv_bytes:
            raise PoolExhausted(
                f"{nbytes} more bytes of K/V would bring the pool to {used + nbytes} bytes; --max-kv-bytes is "
                f"{self.max_kv_bytes} ({used} in use): close a session, use a smaller window, or wait"
            )

    def _evict_kept(self) -> bool:
        """Free one kept session before refusing a live one; whether one was freed."""
        return self.evict_kept is not None and self.evict_kept()

    @contextlib.contextmanager
    def reservation(self, nbytes: int = 0) -> Iterator[None]:
        """Hold one slab while a session is built (its K/V allocated: a create, restore or fork);
        `add(..., reserved=True)` inside takes it, and it is released whatever happens.

        Raises:
            PoolExhausted: all `max_sessions` slabs are in use, or `nbytes` more K/V would exceed
                `max_kv_bytes`.
        """
        self.reserve(nbytes)
        self._reserved += 1
        try:
            yield
        finally:
            self._reserved -= 1

    def add(self, session: Session, reserved: bool = False) -> None:
        """Register a built session (after `reserve`, or inside a `reservation` with `reserved`).

        Raises:
            PoolExhausted: the pool (slabs or --max-kv-bytes) filled up meanwhile.
            InvalidRequest: the id is taken.
        """
        if reserved:
            self.reserve_bytes(session.kv_bytes)
        else:
            self.reserve(session.kv_bytes)
        if session.session_id in self._sessions:
            raise InvalidRequest(f"a session with id {session.tag}… already exists")
        self._sessions[session.session_id] = session
        if self.on_change is not None:
            self.on_change(session)

    def get(self, session_id: str, owner: str = ANONYMOUS) -> Session:
        """The open session with this id, if `owner` owns it.

        Another identity's session is reported exactly as a missing one, so a session
        id reveals nothing to anyone but its owner.

        Raises:
            SessionNotFound: unknown, closed, expired or owned by another identity.
        """
        self.expire_idle()
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise SessionNotFound(f"session {session_id!r} does not exist (never created, closed, or expired)")
        return session

    def close(self, session_id: str, owner: str = ANONYMOUS) -> Session:
        """Close `owner`'s session; its slab frees when its running call (if any) ends.

        Raises:
            SessionNotFound: unknown, already closed or owned by another identity.
        """
        session = self.get(session_id, owner)
        self._remove(session)
        return session

    def sessions(self) -> list[Session]:
        """Every open session."""
        return list(self._sessions.values())

    def _remove(self, session: Session) -> None:
        del self._sessions[session.session_id]
        session.is_closed = True
        if self.on_remove is not None:
            self.on_remove(session)
        if session.is_busy:
            self._draining[session.session_id] = session
        else:
            session.free()

    def release(self, session: Session) -> None:
        """End a call on a session; frees the slab if the session was closed meanwhile."""
        session.release()
        if session.is_closed:
            self._draining.pop(session.session_id, None)
            session.free()
        elif self.on_change is not None:
            self.on_change(session)

    def expire_idle(self) -> list[str]:
        """Close sessions idle for longer than the TTL; returns their ids."""
        cutoff = time.monotonic() - self.ttl_s
        expired = [s for s in self._sessions.values() if not s.is_busy and s.last_used_mono < cutoff]
        for session in expired:
            log.info("session %s… expired after %.0fs idle", session.tag, self.ttl_s)
            self._remove(session)
        return [s.session_id for s in expired]
