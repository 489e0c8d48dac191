"""A session's state out (`capture`, then `seal`) and into a new session (`install`).

`capture` runs on the engine thread at a clean point (the scheduler's `run(..., session=s)`:
no block pending, no step unsent) and only copies the log, the next-token logits and the
canonical K/V into numpy; `seal` then hashes them off the engine thread into the digest the
snapshot records, computed from exactly those bytes the way `state_digest` is.
`install` builds a new coordinator from them and recomputes the digest from the new
caches (on a route: from the workers) before anyone can see the session: a state that does
not reproduce its digest is refused and freed, never half restored.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from inference_engine.errors import SessionNotFound, SnapshotCorrupt
from inference_engine.session.coordinator import SessionCoordinator
from inference_engine.session.session import Session
from inference_engine.session.snapshot_format import Fingerprint, PersistedIdentity, SessionSnapshot
from inference_engine.execution.executor import Backend
from inference_engine.execution.kv_cache import CacheGeometry
from inference_engine.verifier.sink_window_verifier import state_digest


def capture(session: Session, fingerprint: Fingerprint, identity: PersistedIdentity | None = None) -> SessionSnapshot:
    """The session's complete state now (engine thread, at a clean point), its digest not yet computed (`seal`).

    Args:
        fingerprint: where the state may be restored (with this session's sink and window).
        identity: recorded in server-written files only (id, owner, creation time).
    Raises:
        SessionNotFound: the session was closed meanwhile.
        InvariantViolation, RuntimeServiceError: the state could not be read (a failed rebuild, a route).
    """
    if session.is_closed:
        raise SessionNotFound(f"session {session.session_id!r} was closed before its snapshot was taken")
    tokens, logits, kv = session.coordinator.export_state()
    return SessionSnapshot(fingerprint, session.eos_token_ids, session.client_label,
                           np.array(tokens, dtype=np.uint32), logits, kv, "", identity, session.chat,
                           session.constraint)


def seal(snapshot: SessionSnapshot) -> SessionSnapshot:
    """`snapshot` with the digest of the state it holds (GetSessionInfo's; any thread)."""
    f, n = snapshot.fingerprint, snapshot.history_length
    visible = CacheGeometry(f.sink, f.window, 1, 0).visible_positions(n)[:-1] if n else []
    tokens = snapshot.tokens
    digest = state_digest(snapshot.logits, [int(tokens[q]) for q in visible], n, snapshot.kv.layer_digests())
    return dataclasses.replace(snapshot, state_digest=digest)


def install(snapshot: SessionSnapshot, backend: Backend, geometry: CacheGeometry, tag: str = "",
            prepared: object | None = None) -> SessionCoordinator:
    """A new session's coordinator holding exactly the snapshot's state (engine thread).

    Args:
        snapshot: a decoded snapshot already checked against this server (`check_compatible` and shapes).
        geometry: the session's geometry here (the snapshot's sink and window, this engine's block).
        prepared: `backend.prepare(geometry)`'s result, if it ran ahead (off the engine thread).
    Raises:
        SnapshotCorrupt: the loaded state's digest is not the one the snapshot records (freed).
        InvariantViolation, RuntimeServiceError: the backend could not hold it (freed).
    """
    coordinator = SessionCoordinator.from_state(backend, geometry, snapshot.tokens.tolist(), snapshot.logits,
                                                snapshot.kv, tag, prepared)
    try:
        digest = coordinator.state_digest()
        if digest != snapshot.state_digest:
            raise SnapshotCorrupt(f"the restored state's digest {digest[:12]}… is not the "
                                  f"{snapshot.state_digest[:12]}… the snapshot records: its sections do not hold "
                                  "that state; nothing was restored", "data")
    except BaseException:
        coordinator.close()
        raise
    return coordinator
