"""The readiness line: a server or shard worker prints `listening on HOST:PORT` once it serves.

One place writes it and one place waits for it, for every process that starts another
(the supervisor, benchmarks, the smoke client, tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time

PREFIX = "listening on "
EXIT_WAIT_S = 5.0  # a process whose output ended gets this long to exit before it is killed


def announce(host: str, port: int) -> None:
    """Print the readiness line (stdout, flushed)."""
    print(f"{PREFIX}{host}:{port}", flush=True)


def address_of(line: str) -> str | None:
    """The HOST:PORT of a readiness line, or None for any other line."""
    line = line.strip()
    return line.removeprefix(PREFIX) if line.startswith(PREFIX) else None


def wait_ready(proc: subprocess.Popen, timeout_s: float = 300.0) -> str:
    """Block until `proc` (started with text stdout=PIPE) prints its readiness line; return its address.

    Lines before it are skipped.

    Raises:
        OSError: the process ended or stayed silent for `timeout_s` (it is killed then).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        address = address_of(line if isinstance(line, str) else line.decode())
        if address is not None:
            return address
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    raise OSError(f"process {proc.args!r} did not become ready (exit status {proc.returncode})")


async def wait_ready_async(proc: asyncio.subprocess.Process, timeout_s: float = 300.0) -> str:
    """As `wait_ready`, for an asyncio subprocess started with stdout=PIPE.

    Raises:
        OSError: the process ended or stayed silent for `timeout_s` (it is killed then).
    """
    async def first_ready() -> str | None:
        while line := await proc.stdout.readline():
            address = address_of(line.decode())
            if address is not None:
                return address
        return None

    wait_s = EXIT_WAIT_S  # its output ended: it is exiting
    try:
        address = await asyncio.wait_for(first_ready(), timeout_s)
    except asyncio.TimeoutError:
        address, wait_s = None, 0.0  # silent too long: killed now
    if address is not None:
        return address
    # An exiting process is not killed: `kill` polls it first, which can reap it behind asyncio's child
    # watcher, and the watcher then reports "exit status 255" (logging "Unknown child process pid").
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(proc.wait(), wait_s)
    if proc.returncode is None:
        proc.kill()
    await proc.wait()
    raise OSError(f"exit status {proc.returncode}")
