"""How many SnapshotSession and RestoreSession calls may run at once, in all and per identity.

Each holds up to one snapshot in memory (a restore's buffer, a snapshot's bytes while the
client reads them), so the slots bound what transfers can hold: --max-transfers x
--max-snapshot-bytes at most. A call over either bound is refused at once
(RESOURCE_EXHAUSTED with a RetryInfo), before it reads or captures anything; waiting would
let a client that never reads hold every slot and queue the others behind it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

from inference_engine.errors import TooManyTransfers
from inference_engine.short_id import short_id


class TransferSlots:
    """Counts open transfers (one event loop: no lock)."""

    def __init__(self, total: int, per_identity: int):
        """
        Args:
            total: transfers open at once (--max-transfers).
            per_identity: of which one identity may hold (--max-transfers-per-identity).
        """
        self.total = total
        self.per_identity = per_identity
        self.open = 0  # transfers running now
        self._by_owner: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, owner: str) -> Iterator[None]:
        """One slot for `owner` for the duration of a transfer.

        Raises:
            TooManyTransfers: every slot is held, or `owner` holds its share.
        """
        if self.open >= self.total:
            raise TooManyTransfers(f"{self.total} snapshot/restore transfers are running, the most this server "
                                   "allows (--max-transfers); retry shortly")
        if self._by_owner[owner] >= self.per_identity:
            raise TooManyTransfers(f"this identity has {self.per_identity} snapshot/restore transfers running, the "
                                   "most one identity may (--max-transfers-per-identity); retry when one ends")
        self.open += 1
        self._by_owner[owner] += 1
        try:
            yield
        finally:
            self.open -= 1
            self._by_owner[owner] -= 1
            if not self._by_owner[owner]:
                del self._by_owner[owner]

    def __repr__(self) -> str:  # never the identities themselves
        return f"TransferSlots({self.open}/{self.total}: {[short_id(o) for o in self._by_owner]})"
