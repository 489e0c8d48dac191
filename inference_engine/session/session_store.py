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

    def __init__(self, max_sessions: int, ttl_s: float):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._sessions: dict[str, Session] = {}
        self._draining: set[str] = set()  # closed but still busy: slab not yet free
        self._reserved = 0  # slabs held for sessions being built (`reservation`: restores, forks)
        # Observers (--persist-sessions): a session was added or a call on it ended; one was closed or expired.
        self.on_change: Callable[[Session], None] | None = None
        self.on_remove: Callable[[Session], None] | None = None

    @staticmethod
    def new_id() -> str:
        """128 random bits, URL-safe."""
        return secrets.token_urlsafe(16)

    @property
    def slabs_in_use(self) -> int:
        """Open sessions, closed ones whose last call has not finished, and reserved slabs."""
        return len(self._sessions) + len(self._draining) + self._reserved

    def kv_bytes_in_use(self) -> int:
        """K/V bytes of every open session (target and draft slabs)."""
        return sum(s.kv_bytes for s in self._sessions.values())

    def reserve(self) -> None:
        """Check a slab is free before building one.

        Raises:
            PoolExhausted: all `max_sessions` slabs are in use.
        """
        self.expire_idle()
        if self.slabs_in_use >= self.max_sessions:
            raise PoolExhausted(
                f"all {self.max_sessions} session slabs are in use; close a session or wait for idle ones to expire"
            )

    @contextlib.contextmanager
    def reservation(self) -> Iterator[None]:
        """Hold one slab while a session is built (a restore or fork: slow); `add(..., reserved=True)`
        inside takes it, and it is released whatever happens.

        Raises:
            PoolExhausted: all `max_sessions` slabs are in use.
        """
        self.reserve()
        self._reserved += 1
        try:
            yield
        finally:
            self._reserved -= 1

    def add(self, session: Session, reserved: bool = False) -> None:
        """Register a built session (after `reserve`, or inside a `reservation` with `reserved`)."""
        if not reserved:
            self.reserve()
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
            self._draining.add(session.session_id)
        else:
            session.free()

    def release(self, session: Session) -> None:
        """End a call on a session; frees the slab if the session was closed meanwhile."""
        session.release()
        if session.is_closed:
            self._draining.discard(session.session_id)
            session.free()
        elif self.on_change is not None:
            self.on_change(session)

    def close_all(self) -> None:
        """Close every session and free what is idle (shutdown)."""
        for session in list(self._sessions.values()):
            self._remove(session)

    def expire_idle(self) -> list[str]:
        """Close sessions idle for longer than the TTL; returns their ids."""
        cutoff = time.monotonic() - self.ttl_s
        expired = [s for s in self._sessions.values() if not s.is_busy and s.last_used_mono < cutoff]
        for session in expired:
            log.info("session %s… expired after %.0fs idle", session.tag, self.ttl_s)
            self._remove(session)
        return [s.session_id for s in expired]
