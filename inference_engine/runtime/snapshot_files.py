"""Snapshot files on disk: atomic writes and the names a client may use.

A write goes to a temporary file in the same folder, is fsynced, renamed over the target
and the folder fsynced: a crash at any moment leaves either the previous file or the new
one, never a torn one (and a torn temporary is ignored and removed at the next start).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from inference_engine.errors import InvalidRequest

SUFFIX = ".iesnap"
TEMP_MARK = ".tmp-"  # in the names of files being written
FILE_MODE = 0o600  # of every file written here (the folders are 0700)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably (temp file, fsync, rename, fsync of the folder),
    readable and writable by this user only.

    Raises:
        OSError: the folder is not writable or the disk is full (the previous file is intact).
    """
    temp = path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")
    try:
        # 0600 whatever the umask: a session's token log and K/V are its owner's alone.
        with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)  # a leftover temporary would keep its old mode through O_CREAT
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename or unlink in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temporaries(folder: Path) -> int:
    """Delete what interrupted writes left behind; returns how many."""
    stale = [p for p in folder.iterdir() if p.name.startswith(".") and TEMP_MARK in p.name]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def resolve(folder: Path, name: str) -> Path:
    """The path of the snapshot file `name` under `folder` (a plain name: no folders, no `..`).

    Raises:
        InvalidRequest: not a plain file name, or no such file (field `file`).
    """
    if not _NAME.fullmatch(name) or not name.endswith(SUFFIX):
        raise InvalidRequest(f"file {name!r} is not a snapshot file name; allowed: a plain name ending in {SUFFIX} "
                             "(letters, digits, '.', '_', '-'), as SnapshotSession returned it", "file")
    path = folder / name
    if not path.is_file():
        raise InvalidRequest(f"there is no snapshot file {name!r} in the snapshot folder", "file")
    return path
