"""Give freed heap memory back to the operating system (glibc's `malloc_trim`).

Freed Python objects go back to glibc's free lists, not to the system: after a burst of
large transient buffers (a restore's 1 MiB messages, start-up temporaries) the RSS would
stay at its peak. `malloc_trim(0)` returns every free page of every arena.
"""

from __future__ import annotations

import ctypes
import sys


def trim_free_memory() -> None:
    """Return free heap pages to the system (glibc only; elsewhere nothing happens). Blocks for a few ms:
    call it off the event loop."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except AttributeError:  # pragma: no cover - a libc without malloc_trim (musl)
            pass


MMAP_THRESHOLD_BYTES = 256 << 10  # allocations from this size on get their own mapping (glibc's default start)
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def fix_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at MMAP_THRESHOLD_BYTES (server start-up).

    By default glibc raises it to the size of each large block freed (up to 32 MiB), after which
    1 MiB messages of a restore stream come from the heap and stay there, fragmented (+62 MiB
    RSS after two 1 GB uploads, +4.5 % with the threshold fixed). Fixed, every block from 256 KiB
    on is its own mapping, unmapped when freed.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        except AttributeError:  # pragma: no cover - a libc without mallopt (musl)
            pass
