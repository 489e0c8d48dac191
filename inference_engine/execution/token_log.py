"""A session's token log: the one copy of its history.

Everything else holds positions into it: the verifier's cached tokens are the log at the
visible positions, a shard route replays a prefix of it, and a draft cache remembers how
far it has followed it (a `Watermark`, lowered when the log is cut back).

The log only grows, except `truncate`, which removes tokens no client ever saw succeed
(an unsent generation step, an append that was cancelled).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Iterator


class Watermark:
    """How many leading tokens of a log a follower may still trust (lowered by truncation)."""

    def __init__(self, valid: int = 0):
        self.valid = valid  # the first `valid` tokens are unchanged since the follower last set it


class TokenLog:
    """Append-only token ids of one session (see the module docstring for `truncate`)."""

    def __init__(self, tokens: Iterable[int] = ()):
        self._tokens: list[int] = [int(t) for t in tokens]
        self._marks: weakref.WeakSet[Watermark] = weakref.WeakSet()

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._tokens[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenLog):
            return self._tokens == other._tokens
        return isinstance(other, list) and self._tokens == other

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"TokenLog({len(self._tokens)} tokens)"

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens at the next positions."""
        self._tokens.extend(int(t) for t in tokens)

    def truncate(self, length: int) -> None:
        """Cut the log back to its first `length` tokens (never-sent work only); lowers every watermark."""
        if not 0 <= length <= len(self._tokens):
            raise ValueError(f"cannot truncate a log of {len(self._tokens)} tokens to {length}")
        del self._tokens[length:]
        for mark in self._marks:
            mark.valid = min(mark.valid, length)

    def watermark(self) -> Watermark:
        """A new follower's watermark (starts at 0: nothing followed yet)."""
        mark = Watermark()
        self._marks.add(mark)
        return mark

    def tail(self, n: int) -> list[int]:
        """The last `n` tokens (a copy)."""
        return self._tokens[-n:] if n > 0 else []
