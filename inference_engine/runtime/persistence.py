"""`serve --persist-sessions DIR`: live sessions survive a restart, a deploy or a crash.

Policy (README: "Persistence"):
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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from inference_engine.config import prepare_private_folder
from inference_engine.errors import PoolExhausted, RuntimeServiceError
from inference_engine.runtime.session_transfer import SessionTransfer
from inference_engine.runtime.snapshot_files import SUFFIX, fsync_dir, remove_temporaries, write_atomic
from inference_engine.session.session import Session
from inference_engine.session.snapshot_format import PersistedIdentity, decode, encode
from inference_engine.short_id import short_id

log = logging.getLogger(__name__)
PREFIX = "session-"


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
                    log.warning("session %s could not be written (%s: %s); retrying later", session.tag,
                                type(exc).__name__, exc)
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
            await asyncio.to_thread(write_atomic, self.path(session.session_id), data)
            log.debug("session %s written (%d tokens, %d bytes)", session.tag, snap.history_length, len(data))

    async def _delete(self, session_id: str) -> None:
        async with self._lock(session_id):
            path = self.path(session_id)
            if path.exists():
                path.unlink()
                await asyncio.to_thread(fsync_dir, self.folder)
        self._locks.pop(session_id, None)

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
                log.error("session %s could not be written at shutdown (%s: %s)", session.tag, type(exc).__name__,
                          exc)
        log.info("wrote %d live session(s) to %s", written, self.folder)
        return written


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
