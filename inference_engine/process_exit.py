"""Leaving a process that used MLX from worker threads."""

from __future__ import annotations

import logging
import os
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
