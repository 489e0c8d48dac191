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

