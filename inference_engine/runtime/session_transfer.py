"""SnapshotSession, RestoreSession and ForkSession: a session's state out, and into new sessions.

The semantics, over the runtime's store and engine (independent of gRPC):

- A snapshot is taken on the engine thread at the session's next clean point (a running
  Generate between two handed-out steps, an append finished), so it holds exactly what the
  session's clients have seen; encoding and checksumming run off the event loop.
- A restore checks the snapshot whole (checksum, format, compatibility, shapes) before
  anything is allocated, reserves a pool slot, loads the state on the engine thread and
  checks the loaded state's digest against the recorded one before the session is
  registered: it either appears complete, or not at all (its slab freed, here or on a route).
- A fork is a capture and an install without the bytes in between.

The restored or forked session belongs to the caller. `adopt` is also how `--persist-sessions`
brings sessions back with their ids and owners.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_engine.blas import active_blas
from inference_engine.errors import InvalidRequest, InvariantViolation, SnapshotCorrupt, SnapshotIncompatible
from inference_engine.model.loader import model_fingerprint
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.snapshot_files import SUFFIX, resolve, write_atomic
from inference_engine.security.settings import ANONYMOUS
from inference_engine.session.session import Session
from inference_engine.session.snapshot import capture, install, seal
from inference_engine.session.snapshot_format import (
    Fingerprint,
    PersistedIdentity,
    SessionSnapshot,
    check_compatible,
    decode,
    encode,
    retained_count,
)
from inference_engine.short_id import short_id

log = logging.getLogger(__name__)
MAX_EOS_IDS, MAX_LABEL_CHARS = 64, 256  # as CreateSession allows


@dataclass(frozen=True)
class SnapshotParams:
    """A validated SnapshotSession request."""

    session_id: str  # the session to snapshot
    to_dir: bool  # write it under the snapshot folder instead of returning the bytes
    owner: str = ANONYMOUS  # caller's identity (must own the session)


@dataclass(frozen=True)
class SnapshotTaken:
    """Result of SnapshotSession."""

    data: bytes  # the snapshot (empty when written to the folder)
    file: str  # its file name under the snapshot folder ("" when returned)
    size: int  # bytes of the snapshot
    history_length: int  # tokens in the snapshot's log
    state_digest: str  # the digest of the state it holds


@dataclass(frozen=True)
class RestoreParams:
    """A validated RestoreSession request (exactly one of data and file)."""

    data: bytes  # the snapshot's bytes
    file: str  # or a file name under the snapshot folder
    owner: str = ANONYMOUS  # the new session's owner (the caller)


@dataclass(frozen=True)
class SessionRestored:
    """Result of RestoreSession and ForkSession."""

    session_id: str  # the new session's id
    history_length: int  # tokens in its log
    state_digest: str  # == the original's
    sink: int  # its sink tokens
    window: int  # its window tokens


@functools.lru_cache(maxsize=4)
def vocabulary_digest(tokenizer: Any) -> str:
    """Hex SHA-256 of a tokenizer's vocabulary (token -> id), once per tokenizer object (~0.3 s)."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


class SessionTransfer:
    """Snapshots, restores and forks over one runtime."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.engine = runtime.engine
        self.store = runtime.store
        self.config = runtime.config
        self._fingerprint = self._own_fingerprint()  # once, at start-up (it hashes the vocabulary)

    def fingerprint(self, sink: int, window: int) -> Fingerprint:
        """What a snapshot of a session with this sink/window taken here records."""
        return dataclasses.replace(self._fingerprint, sink=sink, window=window)

    def _own_fingerprint(self) -> Fingerprint:
        loaded = self.engine.loaded
        vocab = "none" if loaded.tokenizer is None else vocabulary_digest(loaded.tokenizer)
        return Fingerprint(model_fingerprint(loaded.model), vocab, active_blas(), self.engine.block,
                           self.engine.is_exact, 0, 0)

    # -- out ---------------------------------------------------------------------------

    async def capture(self, session: Session, identity: PersistedIdentity | None = None) -> SessionSnapshot:
        """The session's state at its next clean point (engine thread).

        Raises:
            SessionNotFound: closed meanwhile. RuntimeServiceError: the state could not be read.
        """
        fingerprint = self.fingerprint(session.sink, session.window)
        copied = await self.engine.run(capture, session, fingerprint, identity, session=session)
        return await asyncio.to_thread(seal, copied)  # hashing ~50 MB is no work for the engine thread

    async def snapshot(self, p: SnapshotParams) -> SnapshotTaken:
        """SnapshotSession: the caller's session as bytes, or as a file under the snapshot folder.

        Raises:
            SessionNotFound: unknown, closed or another identity's.
            InvariantViolation: `to_dir` on a server without a snapshot folder, or the file could not be
                written there (disk full, folder removed or read-only; nothing was left behind).
        """
        session = self.store.get(p.session_id, p.owner)
        folder = self._folder() if p.to_dir else None
        session.touch()
        identity = PersistedIdentity(session.session_id, session.owner, session.created_ns) if folder else None
        snap = await self.capture(session, identity)
        data = await asyncio.to_thread(encode, snap)
        if folder is None:
            return SnapshotTaken(data, "", len(data), snap.history_length, snap.state_digest)
        name = f"snap-{session.tag}-{snap.history_length}-{secrets.token_hex(4)}{SUFFIX}"
        with self._folder_errors(folder, "written", "take the snapshot as bytes instead (to_dir false)"):
            await asyncio.to_thread(write_atomic, folder / name, data)
        log.info("session %s: snapshot of %d tokens written to %s (%d bytes)", session.tag, snap.history_length, name,
                 len(data))
        return SnapshotTaken(b"", name, len(data), snap.history_length, snap.state_digest)

    # -- in ------------------------------------------------------------------------------

    async def restore(self, p: RestoreParams) -> SessionRestored:
        """RestoreSession: a new session of the caller's from snapshot bytes or a file of theirs.

        Raises:
            SnapshotCorrupt: truncated, damaged, not a snapshot, or inconsistent with this model.
            SnapshotIncompatible: another format version, model, tokenizer, kernels, block size,
                mode, or a sink/window over this server's limits.
            InvalidRequest: no such file (or another identity's).
            InvariantViolation: `file` without a snapshot folder, or the file could not be read.
            PoolExhausted: no slab is free.
            EngineUnavailable: the server is shutting down (a session made now would not outlive it).
        """
        self.runtime.check_serving()
        self.store.reserve()  # fail fast before reading anything
        data = p.data if not p.file else await self._read_file(p.file)
        snap = await asyncio.to_thread(decode, data)
        if p.file and (snap.identity is None or snap.identity.owner != p.owner):
            raise InvalidRequest(f"there is no snapshot file {p.file!r} in the snapshot folder", "file")
        session = await self.adopt(snap, self.store.new_id(), p.owner)
        log.info("session %s restored from a snapshot by %s (%d tokens)", session.tag, short_id(p.owner),
                 snap.history_length)
        return self._restored(session, snap)

    async def fork(self, session_id: str, owner: str = ANONYMOUS) -> SessionRestored:
        """ForkSession: a new session of the caller's starting as an exact copy of theirs.

        Raises:
            SessionNotFound: unknown, closed or another identity's. PoolExhausted: no slab is free.
            EngineUnavailable: the server is shutting down.
        """
        self.runtime.check_serving()
        source = self.store.get(session_id, owner)
        self.store.reserve()
        source.touch()
        snap = await self.capture(source)
        session = await self.adopt(snap, self.store.new_id(), owner)
        log.info("session %s forked from %s (%d tokens)", session.tag, source.tag, snap.history_length)
        return self._restored(session, snap)

    async def adopt(self, snap: SessionSnapshot, session_id: str, owner: str, created_ns: int | None = None) -> Session:
        """Register a new session holding `snap`'s state (checked first; all or nothing).

        Raises:
            SnapshotIncompatible, SnapshotCorrupt: see `check_fits`. PoolExhausted: no slab is free.
            RuntimeServiceError: the backend could not hold it.
        """
        self.check_fits(snap)
        f = snap.fingerprint
        geometry = self.engine.geometry(f.sink, f.window)
        with self.store.reservation(self.engine.slab_bytes(f.sink, f.window)):  # held from here, released on any failure
            prepared = await asyncio.to_thread(self.engine.prepare_session, f.sink, f.window)  # off the engine thread
            coordinator = await self.engine.run(
                lambda: install(snap, self.engine.backend, geometry, short_id(session_id), prepared))
            session = Session(session_id, coordinator, f.sink, f.window, snap.eos_token_ids, snap.client_label,
                              owner=owner, chat=snap.chat)  # the next chat turn renders as on the original
            if created_ns is not None:
                session.created_ns = created_ns
            try:
                self.store.add(session, reserved=True)
            except BaseException:
                session.free()
                raise
        return session

    def check_fits(self, snap: SessionSnapshot) -> None:
        """Everything a restore here needs, checked before anything is allocated.

        Raises:
            SnapshotIncompatible: format-level fingerprint differences, or sink/window over the limits.
            SnapshotCorrupt: shapes, dtypes or ids that do not fit this model (a damaged or forged file).
        """
        f, spec, cfg = snap.fingerprint, self.engine.spec, self.config
        check_compatible(snap, self.fingerprint(f.sink, f.window))
        if f.sink > cfg.max_sink or not 1 <= f.window <= cfg.max_window:
            raise SnapshotIncompatible(f"the snapshot's session has sink {f.sink} and window {f.window}; this server "
                                       f"allows sink 0..{cfg.max_sink} and window 1..{cfg.max_window}")
        n, kv = snap.history_length, snap.kv
        want = (spec.num_layers, spec.num_kv_heads, retained_count(n, f.sink, f.window), spec.head_dim)
        problems = {
            f"K/V of shape {list(kv.keys.shape)} (this model needs {list(want)})": kv.keys.shape != want,
            f"K/V of dtype {kv.keys.dtype} (this model caches float32)": kv.keys.dtype != "float32",
            "logits of another width than the vocabulary": snap.logits is not None and
            snap.logits.shape != (spec.vocab_size,),
            f"token ids at or above the vocabulary size {spec.vocab_size}": bool(n) and int(snap.tokens.max())
            >= spec.vocab_size,
            "EOS ids out of range": any(t >= spec.vocab_size for t in snap.eos_token_ids)
            or len(snap.eos_token_ids) > MAX_EOS_IDS,
            f"a label over {MAX_LABEL_CHARS} characters": len(snap.client_label) > MAX_LABEL_CHARS,
        }
        bad = [what for what, is_bad in problems.items() if is_bad]
        if bad:
            raise SnapshotCorrupt(f"the snapshot does not fit this model: {'; '.join(bad)}", "data")

    async def _read_file(self, name: str) -> bytes:
        """The bytes of the snapshot file `name` under the snapshot folder.

        Raises:
            InvalidRequest: not a plain snapshot file name, or no such file.
            InvariantViolation: no snapshot folder, or it could not be read.
        """
        folder = self._folder()
        with self._folder_errors(folder, "read", "send the snapshot's bytes instead (data)"):
            return await asyncio.to_thread(resolve(folder, name).read_bytes)

    def _folder(self) -> Path:
        folder = self.config.snapshot_dir
        if folder is None:
            raise InvariantViolation("this server has no snapshot folder (start it with --snapshot-dir DIR); "
                                     "take the snapshot as bytes instead (to_dir false)")
        with self._folder_errors(folder, "created", "take the snapshot as bytes instead (to_dir false)"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # a folder named but not made yet is made private
        return folder

    @staticmethod
    @contextlib.contextmanager
    def _folder_errors(folder: Path, done: str, instead: str) -> Iterator[None]:
        """An OSError inside (disk full, folder removed or made read-only since start-up) becomes
        FAILED_PRECONDITION: the server's folder is what is wrong, not the request, and no traceback helps."""
        try:
            yield
        except OSError as exc:
            log.warning("snapshot folder %s could not be %s (%s: %s)", folder, done, type(exc).__name__, exc)
            why = "it is not a folder" if isinstance(exc, (FileExistsError, NotADirectoryError)) else exc.strerror
            raise InvariantViolation(
                f"the server's snapshot folder could not be {done} ({why or exc}); {instead}") from exc

    @staticmethod
    def _restored(session: Session, snap: SessionSnapshot) -> SessionRestored:
        return SessionRestored(session.session_id, snap.history_length, snap.state_digest, session.sink, session.window)
