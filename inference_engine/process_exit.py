"""Process lifecycle: waiting for a stop signal, and leaving after MLX used worker threads."""

from __future__ import annotations

import asyncio
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


async def wait_for_stop_signal() -> None:
    """Return once SIGTERM or SIGINT arrives (call from the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
