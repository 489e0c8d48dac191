"""`serve --persist-sessions DIR`: live sessions survive a restart, a deploy or a crash.

Policy (docs/snapshots.md: "Persistence"):
- One file per session, `DIR/session-<short id>.iesnap`, in the snapshot format, carrying the
  session's id, owner and creation time.
- A session is written when it has `--persist-every N` completed calls not yet written
  (AppendTokens and Generate; its creation, restore or fork counts as one), in the
  background after the call has answered; and every `--persist-interval S` seconds if it has
  any. A SIGKILL therefore loses at most the calls a session made since its last write
  completed (with N = 1: the calls still being written, typically the last one).
- Graceful shutdown (SIGTERM/SIGINT): after in-flight calls drain, every live session is
  written, so nothing is lost.
- Writes are atomic (temporary file, fsync, rename, fsync of the folder): a crash during a
  write leaves the previous file intact. Closing or expiring a session deletes its file.
- At start-up, before the server reports SERVING, every file is restored with its id and
  owner (same checks as RestoreSession): clients continue as if nothing happened. A file
  that is damaged or was written by an incompatible server is renamed `*.rejected` and
  logged, never half restored; files beyond `--max-sessions` or `--max-kv-bytes` stay for a later start.
- The folder is created 0700 and checked writable at start-up (a folder that is not one, or cannot
  be written, stops the server there rather than losing every session at shutdown); files are 0600.
- A file never passes for a state it does not hold. When a session's latest state cannot be
  written (disk full, folder gone), its older file is renamed `*.iesnap.stale` at once (a
  rename needs no free space) and the write is retried at the next call or tick; a write that
  succeeds replaces it. At start-up a `*.stale` file is not restored: it is logged (WARNING,
  the session's short hash) and removed, so a full disk loses a session rather than silently
  rolling it back. Failures count in `inference_engine_persist_failures_total`; sessions not
  on disk show in `inference_engine_persist_unwritten_sessions` and as NOT_SERVING of the
  health service `inference_engine.persistence`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Callable

from inference_engine import metrics
from inference_engine.config import prepare_private_folder
from inference_engine.errors import PoolExhausted, RuntimeServiceError
from inference_engine.runtime.session_transfer import SessionTransfer
from inference_engine.runtime.snapshot_files import SUFFIX, fsync_dir, remove_temporaries, write_atomic
from inference_engine.session.session import Session
from inference_engine.session.snapshot_format import PersistedIdentity, decode, encode
from inference_engine.short_id import short_id

log = logging.getLogger(__name__)
PREFIX = "session-"
STALE = ".stale"  # appended to the file of a session whose latest state could not be written


class SessionPersistence:
    """Keeps a folder in step with the runtime's live sessions."""

    def __init__(self, transfer: SessionTransfer, folder: Path, every_calls: int = 1, interval_s: float = 30.0):
        """
        Args:
            transfer: the runtime's snapshots (capture, adopt).
            folder: where the session files live (created if missing).
            every_calls: write a session once it has this many unwritten completed calls.
            interval_s: also write every session with unwritten calls this often (0: never).
        """
        self.transfer = transfer
        self.store = transfer.store
        self.folder = folder
        self.every_calls = every_calls
        self.interval_s = interval_s
        self._unwritten: dict[str, int] = {}  # session id -> completed calls not yet in its file
        self._locks: dict[str, asyncio.Lock] = {}  # one write or delete at a time per session
        self._queued: set[str] = set()  # sessions with a write scheduled but not started
        self._tasks: set[asyncio.Task] = set()
        self._ticker: asyncio.Task | None = None
        self._stale: set[str] = set()  # sessions whose latest write failed (their file set aside)
        self.on_durability: Callable[[bool], None] | None = None  # told when "every session is on disk" changes
        metrics.PERSIST_UNWRITTEN.set_function(lambda: len(self._stale))

    def path(self, session_id: str) -> Path:
        """The file of a session."""
        return self.folder / f"{PREFIX}{short_id(session_id)}{SUFFIX}"

    # -- start-up ---------------------------------------------------------------------

    async def restore_all(self) -> int:
        """Bring back every session in the folder with its id and owner; returns how many.

        Raises:
            OSError: the folder is not a folder, or cannot be created, written or read.
        """
        started = time.perf_counter()
        prepare_private_folder(self.folder)  # fail now, not at every write (and lose every session at shutdown)
        if removed := remove_temporaries(self.folder):
            log.warning("removed %d partial session file(s) left by an interrupted write", removed)
        for path in sorted(self.folder.glob(f"{PREFIX}*{SUFFIX}{STALE}")):
            path.unlink()
            log.warning("session %s not restored: its latest state could not be written before the server stopped "
                        "(its older file, %s, was set aside and is now removed)", path.name[len(PREFIX):].split(".")[0],
                        path.name)
        restored = 0
        for path in sorted(self.folder.glob(f"{PREFIX}*{SUFFIX}"), key=lambda p: p.stat().st_mtime):
            try:
                snap = await asyncio.to_thread(lambda: decode(path.read_bytes()))
                i = snap.identity
                if i is None or self.path(i.session_id) != path:
                    raise RuntimeServiceError(f"{path.name} does not name the session it holds")
                await self.transfer.adopt(snap, i.session_id, i.owner, i.created_ns)
            except PoolExhausted as exc:  # the slabs or the K/V bytes ran out: name the flag that bounds them
                store = self.store
                limit = (f"--max-sessions {store.max_sessions}" if store.slabs_in_use >= store.max_sessions
                         else f"--max-kv-bytes {store.max_kv_bytes}")
                log.warning("%s reached: %s and later session files stay on disk for a later start (%s)", limit,
                            path.name, exc)
                break
            except (RuntimeServiceError, OSError) as exc:
                rejected = path.with_name(path.name + ".rejected")
                path.replace(rejected)
                log.error("session file %s cannot be restored (%s: %s); kept as %s", path.name, type(exc).__name__,
                          exc, rejected.name)
                continue
            self._unwritten[i.session_id] = 0
            restored += 1
        log.info("restored %d session(s) from %s in %.2f s", restored, self.folder, time.perf_counter() - started)
        return restored

    def start(self) -> None:
        """Follow the store from now on (call from the event loop, after `restore_all`)."""
        self.store.on_change = self._changed
        self.store.on_remove = self._removed
        if self.interval_s > 0:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    # -- following the store ----------------------------------------------------------------

    def _changed(self, session: Session) -> None:
        calls = self._unwritten.get(session.session_id, 0) + 1
        self._unwritten[session.session_id] = calls
        if calls >= self.every_calls:
            self._schedule(self._write(session))

    def _removed(self, session: Session) -> None:
        self._unwritten.pop(session.session_id, None)
        self._queued.discard(session.session_id)
        self._schedule(self._delete(session.session_id))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for session in self.store.sessions():
                if self._unwritten.get(session.session_id):
                    self._schedule(self._write(session))

    def _schedule(self, coro) -> None:  # noqa: ANN001 - a coroutine of _write/_delete
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _lock(self, session_id: str) -> asyncio.Lock:
        return self._locks.setdefault(session_id, asyncio.Lock())

    async def _write(self, session: Session) -> None:
        """Write one session (coalesced: a write already waiting covers later calls)."""
        sid = session.session_id
        if sid in self._queued:
            return
        self._queued.add(sid)
        async with self._lock(sid):
            self._queued.discard(sid)
            if session.is_closed:
                return
            pending = self._unwritten.get(sid, 0)
            try:
                await self.save(session)
            except Exception as exc:  # noqa: BLE001 - retried at the next call or tick; serving goes on
                if not session.is_closed:  # closed meanwhile: there is nothing left to write
                    self._failed(session, exc, "retrying later")
                return
            if sid in self._unwritten:
                self._unwritten[sid] = max(0, self._unwritten[sid] - pending)

    async def save(self, session: Session) -> None:
        """Capture and write one session now (atomically).

        Raises:
            RuntimeServiceError: the state could not be read. OSError: the file could not be written.
        """
        identity = PersistedIdentity(session.session_id, session.owner, session.created_ns)
        snap = await self.transfer.capture(session, identity)
        data = await asyncio.to_thread(encode, snap)
        if not session.is_closed:  # closed meanwhile: its file must not come back
            path = self.path(session.session_id)
            await asyncio.to_thread(write_atomic, path, data)
            log.debug("session %s written (%d tokens, %d bytes)", session.tag, snap.history_length, len(data))
            if session.session_id in self._stale:  # current again: the set-aside file goes
                self._stale.discard(session.session_id)
                await asyncio.to_thread(_remove, _stale_path(path))
                log.info("session %s written again after failed writes", session.tag)
                self._tell_durability()

    def _failed(self, session: Session, exc: Exception, then: str) -> None:
        """A write of `session` failed: its older file is set aside (renamed *.stale) now, so neither a
        restart nor a crash brings it back as if it were current."""
        metrics.PERSIST_FAILURES.inc()
        path = self.path(session.session_id)
        try:
            if path.exists():
                path.replace(_stale_path(path))  # a rename: no free space needed
        except OSError as rename_error:
            try:
                path.unlink()
            except OSError:
                log.error("session %s: its file %s could be neither set aside nor removed (%s)", session.tag,
                          path.name, rename_error)
        log.warning("session %s could not be written (%s: %s); its older file is set aside as stale; %s",
                    session.tag, type(exc).__name__, exc, then)
        if session.session_id not in self._stale:
            self._stale.add(session.session_id)
            self._tell_durability()

    def _tell_durability(self) -> None:
        if self.on_durability is not None:
            self.on_durability(not self._stale)

    async def _delete(self, session_id: str) -> None:
        async with self._lock(session_id):
            path = self.path(session_id)
            if any([_remove(path), _remove(_stale_path(path))]):
                await asyncio.to_thread(fsync_dir, self.folder)
        self._locks.pop(session_id, None)
        if session_id in self._stale:
            self._stale.discard(session_id)
            self._tell_durability()

    # -- shutdown -----------------------------------------------------------------------

    async def close(self) -> int:
        """Stop following the store and write every live session not already on disk as it is (graceful
        shutdown); returns how many were written."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        self.store.on_change = self.store.on_remove = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        written = 0
        for session in self.store.sessions():
            if self._unwritten.get(session.session_id) == 0 and self.path(session.session_id).exists():
                continue  # its file already holds every completed call
            try:
                async with self._lock(session.session_id):
                    await self.save(session)
                written += 1
            except Exception as exc:  # noqa: BLE001 - the others are still written
                self._failed(session, exc, "it will not be restored")
                log.error("session %s could not be written at shutdown (%s: %s)", session.tag, type(exc).__name__,
                          exc)
        log.info("wrote %d live session(s) to %s", written, self.folder)
        return written


def _stale_path(path: Path) -> Path:
    return path.with_name(path.name + STALE)


def _remove(path: Path) -> bool:
    """Delete `path` if it exists; whether it did."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


async def open_persistence(transfer: SessionTransfer, folder: Path | None, every_calls: int,
                           interval_s: float) -> SessionPersistence | None:
    """Restore the sessions of `folder` and follow the store from now on (None without a folder).

    Raises:
        OSError: the folder is not a folder, or cannot be created, written or read.
    """
    if folder is None:
        return None
    persistence = SessionPersistence(transfer, folder, every_calls, interval_s)
    await persistence.restore_all()
    persistence.start()
    return persistence
