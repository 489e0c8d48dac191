"""A `python -m inference_engine serve` child process: started, measured (RSS), signalled, reaped."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from inference_engine.readiness import wait_ready_async

READY_TIMEOUT_S = 600.0  # a cold start converts the packaged model first


@dataclass
class ServerProcess:
    """A server this battery started; its address once it printed its readiness line."""

    proc: asyncio.subprocess.Process
    target: str  # HOST:PORT
    flags: tuple[str, ...]  # the `serve` flags it was started with
    log_path: Path | None = None  # its stderr

    @classmethod
    async def start(cls, flags: Sequence[str], log_path: Path | None = None, cwd: Path | None = None,
                    ready_timeout_s: float = READY_TIMEOUT_S) -> "ServerProcess":
        """Start `serve --port 0 FLAGS` and wait until it serves.

        Raises:
            OSError: it exited or stayed silent before its readiness line (see its log).
        """
        stderr = log_path.open("wb") if log_path is not None else subprocess.DEVNULL
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inference_engine", "serve", "--port", "0", *flags,
                cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=stderr, stdin=asyncio.subprocess.DEVNULL)
        finally:
            if log_path is not None:
                stderr.close()  # the child keeps its own handle
        try:
            target = await wait_ready_async(proc, ready_timeout_s)
        except OSError as exc:
            raise OSError(f"serve {' '.join(flags)} did not become ready ({exc}; log: {log_path})") from None
        return cls(proc, target, tuple(flags), log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        """Resident set size in bytes (Linux /proc, else `ps`)."""
        status = Path(f"/proc/{self.pid}/status")
        if status.is_file():
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(self.pid)], capture_output=True, text=True, check=True)
        return int(out.stdout.strip()) * 1024

    def terminate(self) -> None:
        """Send SIGTERM (the server drains and exits 0)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    async def wait(self, timeout_s: float) -> int | None:
        """Its exit status, or None if it is still running after `timeout_s`."""
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None

    async def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM and wait; SIGKILL after `timeout_s`. Returns the exit status (None if it had to be killed)."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        self.terminate()
        status = await self.wait(timeout_s)
        if status is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        return status


def exposure_refused(python: str = sys.executable, timeout_s: float = 120.0) -> tuple[bool, str]:
    """`serve --host 0.0.0.0` without TLS and authentication must refuse to start (exit 2, saying why)."""
    out = subprocess.run([python, "-m", "inference_engine", "serve", "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    ok = out.returncode == 2 and "not a loopback address" in out.stderr and "--insecure-public" in out.stderr
    return ok, f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ''}"
