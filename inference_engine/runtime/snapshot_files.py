"""Snapshot files on disk: atomic writes and the names a client may use.

A write goes to a temporary file in the same folder, is fsynced, renamed over the target
and the folder fsynced: a crash at any moment leaves either the previous file or the new
one, never a torn one (and a torn temporary is ignored and removed at the next start).
"""

from __future__ import annotations

import errno
import os
import re
import stat
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


def no_such_file(name: str) -> InvalidRequest:
    """The refusal of a file that is missing or another caller's: the two read the same, so a name reveals nothing."""
    return InvalidRequest(f"there is no snapshot file {name!r} of yours in the snapshot folder (RestoreSession "
                          "takes the files SnapshotSession wrote there for the same caller)", "file")


def open_snapshot(folder: Path, name: str, limit: int) -> tuple[int, int]:
    """Open the snapshot file `name` directly inside `folder` for reading: a regular file, not followed
    through a symlink (O_NOFOLLOW, relative to the folder's own descriptor), never blocking on a FIFO, and
    its size checked against `limit` before a byte is read.

    Args:
        folder: the snapshot folder. name: the file's plain name. limit: --max-snapshot-bytes.
    Returns:
        The open descriptor (the caller closes it) and the file's size.
    Raises:
        InvalidRequest: not a plain snapshot file name, no such file, not a regular file (a symlink, a FIFO,
            a folder), or over `limit` (field `file`).
        OSError: the folder cannot be opened (removed, not a folder, unreadable).
    """
    if not _NAME.fullmatch(name) or not name.endswith(SUFFIX):
        raise InvalidRequest(f"file {name!r} is not a snapshot file name; allowed: a plain name ending in {SUFFIX} "
                             "(letters, digits, '.', '_', '-'), as SnapshotSession returned it", "file")
    folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
    except FileNotFoundError:
        raise no_such_file(name) from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise InvalidRequest(f"{name!r} in the snapshot folder is a symbolic link; allowed: regular files "
                             "SnapshotSession wrote there", "file") from None
    finally:
        os.close(folder_fd)
    info = os.fstat(fd)
    refusal = (f"{name!r} in the snapshot folder is not a regular file; allowed: regular files SnapshotSession "
               "wrote there" if not stat.S_ISREG(info.st_mode) else
               f"snapshot file {name!r} has {info.st_size} bytes; allowed up to {limit} (--max-snapshot-bytes)"
               if info.st_size > limit else "")
    if refusal:
        os.close(fd)
        raise InvalidRequest(refusal, "file")
    return fd, info.st_size
