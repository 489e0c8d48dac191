"""A worker's table of route sessions: live streams, newest epochs, early cancels.

Epochs are per route session id: a SessionOpen with a higher epoch replaces the live
session (which fails closed with EPOCH_STALE); anything with an older epoch than the
newest seen is EPOCH_STALE. A whole-session Cancel for a session that is not open yet
leaves a tombstone, so opening that session (at that epoch or below) fails closed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from inference_engine.errors import InvalidRequest
from inference_engine.shard.protocol.errors import EpochStale, WorkCancelled


class LiveStream(Protocol):
    """What the table needs of a session stream (session_stream.SessionStream)."""

    route_session_id: str  # the route session it serves
    epoch: int  # the route epoch it was opened at

    def fail(self, exc: BaseException, step: int = 0) -> None:
        """End the stream closed with `exc`."""

    def cancel_item(self, work_id: int) -> bool:
        """Cancel one work item; whether it was pending or running."""


SessionStream = TypeVar("SessionStream", bound=LiveStream)

REMEMBERED_IDS = 65536  # route session ids whose newest epoch / tombstone is remembered


class RouteTable(Generic[SessionStream]):
    """Live session streams of one worker, by route session id."""

    def __init__(self, remembered: int = REMEMBERED_IDS):
        self._live: dict[str, SessionStream] = {}
        self._epochs: OrderedDict[str, int] = OrderedDict()  # newest epoch seen per id
        self._tombstones: OrderedDict[str, int] = OrderedDict()  # cancelled up to this epoch
        self._remembered = remembered

    def _remember(self, table: OrderedDict[str, int], rsid: str, epoch: int) -> None:
        table[rsid] = max(epoch, table.get(rsid, 0))
        table.move_to_end(rsid)
        while len(table) > self._remembered:
            table.popitem(last=False)

    def _check_epoch(self, rsid: str, epoch: int, what: str) -> None:
        seen = self._epochs.get(rsid, 0)
        if epoch < seen:
            raise EpochStale(f"{what} for {rsid!r} at route epoch {epoch}, but epoch {seen} is current")

    def admit(self, stream: SessionStream) -> None:
        """Register a stream whose SessionOpen was validated; supersede an older epoch.

        Raises:
            EpochStale: a newer epoch of this route session has been seen.
            WorkCancelled: the session was cancelled before it was opened.
            InvalidRequest: the session is already open at this epoch.
        """
        rsid, epoch = stream.route_session_id, stream.epoch
        self._check_epoch(rsid, epoch, "SessionOpen")
        cancelled_upto = self._tombstones.get(rsid, 0)
        if epoch <= cancelled_upto:
            raise WorkCancelled(f"session {rsid!r} was cancelled (up to route epoch {cancelled_upto}) before it opened")
        live = self._live.get(rsid)
        if live is not None:
            if live.epoch == epoch:
                raise InvalidRequest(f"session {rsid!r} is already open at route epoch {epoch}")
            live.fail(EpochStale(f"session {rsid!r} was superseded by route epoch {epoch}"))
        self._live[rsid] = stream
        self._remember(self._epochs, rsid, epoch)

    def remove(self, stream: SessionStream) -> None:
        """Forget a stream that has ended (no-op if a newer one replaced it)."""
        if self._live.get(stream.route_session_id) is stream:
            del self._live[stream.route_session_id]

    def cancel(self, rsid: str, epoch: int, work_id: int) -> tuple[bool, bool]:
        """Out-of-band Cancel of one item (work_id) or the whole session (work_id 0).

        Returns:
            (a live session at this epoch existed, something was cancelled).
        Raises:
            EpochStale: a newer epoch of this route session is current.
        """
        self._check_epoch(rsid, epoch, "Cancel")
        live = self._live.get(rsid)
        if live is not None and live.epoch == epoch:
            if work_id:
                return True, live.cancel_item(work_id)
            live.fail(WorkCancelled(f"session {rsid!r} was cancelled by an out-of-band Cancel"))
            return True, True
        if work_id:
            return False, False
        if live is not None:  # an older epoch: the whole route session is being cancelled
            live.fail(WorkCancelled(f"session {rsid!r} was cancelled at route epoch {epoch}"))
        self._remember(self._tombstones, rsid, epoch)
        self._remember(self._epochs, rsid, epoch)
        return False, True

    def live(self, rsid: str, epoch: int, what: str) -> SessionStream | None:
        """The live stream of this session at exactly this epoch, if any (`what`: the caller's request,
        named by a stale-epoch error).

        Raises:
            EpochStale: a newer epoch of this route session is current.
        """
        self._check_epoch(rsid, epoch, what)
        stream = self._live.get(rsid)
        return stream if stream is not None and stream.epoch == epoch else None

    def all_live(self) -> list[SessionStream]:
        """Every live stream (for shutdown)."""
        return list(self._live.values())
