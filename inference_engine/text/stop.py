"""Stop strings matched on streamed text across token boundaries.

Text that could be the start of a stop string is held back until it either completes a
match (the text is cut where the match begins) or can no longer match (it is released),
so no emitted text ever has to be taken back.
"""

from __future__ import annotations

from typing import Sequence


def _partial_match(buf: str, stop: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(buf)), 0, -1):
        if buf.endswith(stop[:n]):
            return n
    return 0


class StopMatcher:
    """Finds the first occurrence of any stop string in text pushed piece by piece."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""  # unreleased text: a suffix that is a proper prefix of some stop string

    def push(self, text: str) -> tuple[str, bool]:
        """Add streamed text.

        Returns:
            (text safe to emit now, matched). On a match the text ends where the earliest
            stop string begins and the matcher is done (later pushes are not expected).
        """
        buf = self._held + text
        starts = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if starts:
            self._held = ""
            return buf[: min(starts)], True
        hold = max((_partial_match(buf, s) for s in self.stops), default=0)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release the held-back text (the stream ended without a match)."""
        held, self._held = self._held, ""
        return held
