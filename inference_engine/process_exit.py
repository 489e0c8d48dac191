"""Process lifecycle: waiting for a stop signal, and leaving after MLX used worker threads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys


def exit_now(status: int) -> None:
    """Flush everything and leave without running C++ static destructors.

    MLX used from a worker thread can abort at interpreter exit ("terminate called
    without an active exception", ml-explore/mlx#3126); the server has already drained
    and released everything, so skipping those destructors loses nothing.
    """
    logging.shutdown()
    try:
        import coverage

        cov = coverage.Coverage.current()
        if cov is not None:
            cov.stop()  # lines after this run but cannot be measured
            cov.save()  # pragma: no cover
    except ImportError:  # pragma: no cover - coverage is a test-only dependency
        pass  # pragma: no cover
    sys.stdout.flush()  # pragma: no cover
    sys.stderr.flush()  # pragma: no cover
    os._exit(status)  # pragma: no cover


def stop_event() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets from now on (call from the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def wait_for_stop_signal(parent_pid: int = 0, poll_s: float = 0.5, stop: asyncio.Event | None = None) -> None:
    """Return once SIGTERM or SIGINT arrives (call from the running event loop).

    Args:
        parent_pid: also return once this process is no longer our parent (it died, even by
            SIGKILL, and we were re-parented); 0 = only signals.
        poll_s: how often the parent is checked.
        stop: a `stop_event` installed earlier (a signal that came before this call counts); None: from now.
    """
    stop = stop or stop_event()
    if not parent_pid:
        await stop.wait()
        return
    while not stop.is_set():
        if os.getppid() != parent_pid:
            logging.getLogger(__name__).warning("parent process %d is gone: shutting down", parent_pid)
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
