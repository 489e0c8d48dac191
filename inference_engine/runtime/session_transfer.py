"""SnapshotSession, RestoreSession and ForkSession: a session's state out, and into new sessions.

The semantics, over the runtime's store and engine (independent of gRPC):

- A snapshot is taken on the engine thread at the session's next clean point (a running
  Generate between two handed-out steps, an append finished), so it holds exactly what the
  session's clients have seen; encoding and checksumming run off the event loop.
- A restore reads the snapshot's head first (format version, fingerprint, sink/window, the
  declared size against --max-snapshot-bytes, the owner of a file) and reserves the pool slot
  and K/V bytes before it takes the body, which goes into one buffer of the declared size
  (`snapshot_intake.py`); then it checks the snapshot whole (checksum, format, compatibility,
  shapes), loads the state on the engine thread and checks the loaded state's digest against
  the recorded one before the session is registered: it either appears complete, or not at
  all (its slab freed, here or on a route).
- Transfers are bounded (`transfer_slots.py`): the servicer holds a slot for each
  SnapshotSession and RestoreSession call, so at most --max-transfers snapshots are in memory.
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
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_engine.serving_path import kernels_in_use
from inference_engine.errors import (
    FeatureUnavailable,
    InvalidConstraint,
    InvalidRequest,
    InvariantViolation,
    RuntimeServiceError,
    SnapshotCorrupt,
    SnapshotIncompatible,
)
from inference_engine.model.loader import model_fingerprint
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.snapshot_files import SUFFIX, no_such_file, open_snapshot, write_atomic
from inference_engine.runtime.snapshot_intake import SnapshotIntake
from inference_engine.runtime.transfer_slots import TransferSlots
from inference_engine.security.settings import ANONYMOUS
from inference_engine.session.session import Session
from inference_engine.session.snapshot import capture, install, seal
from inference_engine.session.snapshot_format import (
    Fingerprint,
    PersistedIdentity,
    SessionSnapshot,
    SnapshotHead,
    check_compatible,
    decode,
    encode,
    retained_count,
)
from inference_engine.short_id import short_id

log = logging.getLogger(__name__)
MAX_EOS_IDS, MAX_LABEL_CHARS = 64, 256  # as CreateSession allows
FILE_CHUNK_BYTES = 1 << 20  # bytes per read of a RestoreSession(file)


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

    data: bytes | AsyncIterable[bytes]  # the snapshot's bytes, whole or as they arrive
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


def _close_unwanted(built: asyncio.Future[Any]) -> None:
    """A done install whose caller was cancelled: close the coordinator it built (its slab, here or on a route)."""
    if not built.cancelled() and built.exception() is None:
        built.result().close()


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
        self.slots = TransferSlots(self.config.max_transfers, self.config.max_transfers_per_identity)

    def fingerprint(self, sink: int, window: int) -> Fingerprint:
        """What a snapshot of a session with this sink/window taken here records."""
        return dataclasses.replace(self._fingerprint, sink=sink, window=window)

    def _own_fingerprint(self) -> Fingerprint:
        loaded = self.engine.loaded
        vocab = "none" if loaded.tokenizer is None else vocabulary_digest(loaded.tokenizer)
        return Fingerprint(model_fingerprint(loaded.model), vocab, kernels_in_use(), self.engine.block,
                           self.engine.is_exact, 0, 0)

    # -- out ---------------------------------------------------------------------------

    async def capture(self, session: Session, identity: PersistedIdentity | None = None,
                      taken: asyncio.Event | None = None) -> SessionSnapshot:
        """The session's state at its next clean point (engine thread).

        Args:
            taken: set once the state is copied (before it is sealed): the session may move on.
        Raises:
            SessionNotFound: closed meanwhile. RuntimeServiceError: the state could not be read.
        """
        fingerprint = self.fingerprint(session.sink, session.window)
        copied = await self.engine.run(capture, session, fingerprint, identity, session=session)
        if taken is not None:
            taken.set()
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

        The head is checked and the slot reserved before the body is taken (see the module docstring).

        Raises:
            SnapshotCorrupt: truncated, damaged, not a snapshot, or inconsistent with this model.
            SnapshotIncompatible: another format version, model, tokenizer, kernels, block size,
                mode, or a sink/window over this server's limits.
            InvalidRequest: no bytes; over --max-snapshot-bytes; no such file (or another identity's),
                or not a regular file.
            InvariantViolation: `file` without a snapshot folder, or the file could not be read.
            PoolExhausted: no slab is free.
            EngineUnavailable: the server is shutting down (a session made now would not outlive it).
        """
        self.runtime.check_serving()
        self.store.reserve()  # fail fast before reading anything
        intake = SnapshotIntake(self.config.max_snapshot_bytes)
        try:
            session, snap = await self._take(intake, p)
        finally:
            intake.release()  # a failed call's traceback keeps this frame, never the buffer
        log.info("session %s restored from a snapshot by %s (%d tokens)", session.tag, short_id(p.owner),
                 snap.history_length)
        return self._restored(session, snap)

    async def _take(self, intake: SnapshotIntake, p: RestoreParams) -> tuple[Session, SessionSnapshot]:
        """Read, check and install the snapshot of `p` through `intake` (see `restore`)."""
        source = self._file_chunks(p.file) if p.file else _chunks(p.data)
        async with contextlib.aclosing(source), contextlib.AsyncExitStack() as reserved:
            async for chunk in source:
                head = intake.feed(chunk)
                if head is not None:  # before the body: refuse it, or reserve its slab
                    self._check_head(head, p)
                    f = head.fingerprint
                    reserved.enter_context(self.store.reservation(self.engine.slab_bytes(f.sink, f.window)))
            try:
                snap = await asyncio.to_thread(decode, intake.finish())
            except RuntimeServiceError as exc:
                # Without the frames below this one: to_thread's and decode's hold the buffer, and an error's
                # traceback lives on in a reference cycle until a full collection (RSS kept +1 buffer per call).
                raise exc.with_traceback(None)
            intake.release()  # the arrays of `snap` keep what they use
            self._check_owner(snap.identity, p)
            self.check_fits(snap)
            await self.check_constraint(snap)
            return await self._install(snap, self.store.new_id(), p.owner), snap

    def _check_head(self, head: SnapshotHead, p: RestoreParams) -> None:
        """What the head alone decides: the owner of a file, the fingerprint, sink and window.

        Raises:
            InvalidRequest: another identity's file. SnapshotIncompatible: see `check_fits`.
        """
        self._check_owner(head.identity, p)
        f = head.fingerprint
        check_compatible(head, self.fingerprint(f.sink, f.window))
        self._check_limits(f.sink, f.window)

    @staticmethod
    def _check_owner(identity: PersistedIdentity | None, p: RestoreParams) -> None:
        if p.file and (identity is None or identity.owner != p.owner):  # as if missing: names reveal nothing
            raise no_such_file(p.file)

    def _check_limits(self, sink: int, window: int) -> None:
        cfg = self.config
        if sink > cfg.max_sink or not 1 <= window <= cfg.max_window:
            raise SnapshotIncompatible(f"the snapshot's session has sink {sink} and window {window}; this server "
                                       f"allows sink 0..{cfg.max_sink} and window 1..{cfg.max_window}")

    async def fork(self, session_id: str, owner: str = ANONYMOUS, taken: asyncio.Event | None = None
                   ) -> SessionRestored:
        """ForkSession: a new session of the caller's starting as an exact copy of theirs.

        Args:
            taken: set once the source's state is copied: the source may move on (generate) while
                the copy is sealed and installed.
        Raises:
            SessionNotFound: unknown, closed or another identity's. PoolExhausted: no slab is free.
            EngineUnavailable: the server is shutting down.
        """
        self.runtime.check_serving()
        source = self.store.get(session_id, owner)
        self.store.reserve()
        source.touch()
        snap = await self.capture(source, taken=taken)
        # The constraint run the capture saw is this server's own, compiled already: not checked again.
        session = await self.adopt(snap, self.store.new_id(), owner, is_own_constraint=True)
        log.info("session %s forked from %s (%d tokens)", session.tag, source.tag, snap.history_length)
        return self._restored(session, snap)

    async def adopt(self, snap: SessionSnapshot, session_id: str, owner: str, created_ns: int | None = None,
                    is_own_constraint: bool = False) -> Session:
        """Register a new session holding `snap`'s state (checked first; all or nothing).

        Args:
            is_own_constraint: `snap`'s constraint run is a live session's here (a fork): its compile is skipped.
        Raises:
            SnapshotIncompatible, SnapshotCorrupt: see `check_fits`. PoolExhausted: no slab is free.
            RuntimeServiceError: the backend could not hold it.
        """
        self.check_fits(snap)
        if not is_own_constraint:
            await self.check_constraint(snap)
        f = snap.fingerprint
        with self.store.reservation(self.engine.slab_bytes(f.sink, f.window)):  # held from here, released on any failure
            return await self._install(snap, session_id, owner, created_ns)

    async def _install(self, snap: SessionSnapshot, session_id: str, owner: str,
                       created_ns: int | None = None) -> Session:
        """Build and register the session of a checked snapshot, inside the caller's `reservation`."""
        f = snap.fingerprint
        geometry = self.engine.geometry(f.sink, f.window)
        prepared = await asyncio.to_thread(self.engine.prepare_session, f.sink, f.window)  # off the engine thread
        built = asyncio.ensure_future(self.engine.run(
            lambda: install(snap, self.engine.backend, geometry, short_id(session_id), prepared)))
        try:
            coordinator = await asyncio.shield(built)
        except asyncio.CancelledError:  # the install completes anyway (Scheduler.run): free its slab, here or on a route
            built.add_done_callback(_close_unwanted)  # also when this task is cancelled again while it waits
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait((built,))
            raise
        session = Session(session_id, coordinator, f.sink, f.window, snap.eos_token_ids, snap.client_label,
                          owner=owner, chat=snap.chat,  # the next chat turn renders as on the original
                          constraint=snap.constraint)  # and a constrained output continues as on the original
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
        f, spec = snap.fingerprint, self.engine.spec
        check_compatible(snap, self.fingerprint(f.sink, f.window))
        self._check_limits(f.sink, f.window)
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

    async def check_constraint(self, snap: SessionSnapshot) -> None:
        """The snapshot's constraint is one a request could pass here and compiles, as the next constrained call
        will compile it (off the loop; before the session is installed: a restore's slab is reserved by then, since the
        constraint is in the body, and is given back if this fails).

        Raises:
            SnapshotCorrupt: its source is over --max-text-chars (a request's bound, checked before compiling), it
                does not compile, or this model has no tokenizer (its writer could not have run one).
        """
        if snap.constraint is None:
            return
        c, limit = snap.constraint.constraint, self.config.max_text_chars
        if len(c.source) > limit:
            raise SnapshotCorrupt(f"the snapshot's {c.kind} constraint has {len(c.source)} characters; a request's "
                                  f"constraint may have at most {limit} (--max-text-chars)", "data")
        try:
            await asyncio.to_thread(self.runtime.constraints.matcher, c)
        except (InvalidConstraint, FeatureUnavailable) as exc:
            raise SnapshotCorrupt(f"the snapshot's {c.kind} constraint cannot run here: {exc}", "data") from None

    async def _file_chunks(self, name: str) -> AsyncIterator[bytes]:
        """The bytes of the snapshot file `name` under the snapshot folder, a chunk at a time
        (`open_snapshot`: a regular file inside the folder, not over --max-snapshot-bytes).

        Raises:
            InvalidRequest: not a plain snapshot file name, no such file, not a regular file, or too large.
            InvariantViolation: no snapshot folder, or it could not be read.
        """
        folder = self._folder()
        with self._folder_errors(folder, "read", "send the snapshot's bytes instead (data)"):
            fd, _ = await asyncio.to_thread(open_snapshot, folder, name, self.config.max_snapshot_bytes)
            try:
                while chunk := await asyncio.to_thread(os.read, fd, FILE_CHUNK_BYTES):
                    yield chunk
            finally:
                os.close(fd)

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


async def _chunks(data: bytes | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """`data` as chunks: the given ones, or one (whole bytes)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for offset in range(0, len(view), FILE_CHUNK_BYTES):
            yield bytes(view[offset : offset + FILE_CHUNK_BYTES])
        return
    async for chunk in data:
        yield chunk
