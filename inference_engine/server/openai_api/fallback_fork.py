"""A prompt's fallback fork: a bitwise copy of its session, taken before the reply, kept in the prefix cache.

A reply longer than --max-rollback cannot be rolled back, so a next turn that renders it to other
tokens (re-tokenized, or edited by the client) near its start finds no usable full session. The
fork, whose history is the prompt alone, serves that turn's prompt up to the reply (see
prefix_cache.py for when one is taken and how it is evicted).

Off the request's path: it waits only until the engine thread has copied the prompt's state
(`SessionTransfer.fork(taken=...)`); sealing and installing the copy (hashing it, a new slab) go
on beside the reply's decoding, and the fork joins the cache when it is built, just before its
request's full session in LRU order. The reply's end does not wait for it; the identity's next
request does (`PrefixCache.settled`, bounded), since that turn is the one a fork serves: the
fork is tracked from its request's end, so concurrent requests of one identity (every
unauthenticated client) never wait for each other's forks while they decode.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from typing import Callable

from inference_engine import metrics
from inference_engine.errors import RuntimeServiceError, SessionNotFound
from inference_engine.runtime.session_transfer import SessionRestored, SessionTransfer
from inference_engine.server.openai_api.prefix_cache import PrefixCache
from inference_engine.short_id import short_id

log = logging.getLogger(__name__)


class FallbackFork:
    """One request's fallback fork, from `start` (the prompt is in) to `finish` (the request ended)."""

    def __init__(self, cache: PrefixCache, transfer: SessionTransfer, owner: str, is_draining: Callable[[], bool]):
        """
        Args:
            cache: where the fork is kept.
            transfer: the runtime's ForkSession path.
            owner: the request's identity (the fork is its session).
            is_draining: the server is shutting down (a fork built then is closed, not kept).
        """
        self.cache = cache
        self.transfer = transfer
        self.owner = owner
        self.is_draining = is_draining
        self.session_id: str | None = None  # once built and kept
        self._source: str | None = None  # the request's session (kept after the fork, when it ends)
        self._is_wanted = True
        self._task: asyncio.Future[SessionRestored] | None = None

    async def start(self, session_id: str) -> None:
        """Fork `session_id`; returns once its state is copied (or the fork failed): it may then generate."""
        taken = asyncio.Event()
        self._source = session_id
        self._task = asyncio.ensure_future(self.transfer.fork(session_id, self.owner, taken))
        self._task.add_done_callback(self._built)
        self.cache.fork_started(self._task)
        copied = asyncio.ensure_future(taken.wait())
        try:
            await asyncio.wait((copied, self._task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            copied.cancel()

    def _built(self, task: asyncio.Future[SessionRestored]) -> None:
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:  # a fallback never fails its request
            # The type and, for a defect, the frames: no message (one may hold the session's full id).
            is_expected = isinstance(exc, RuntimeServiceError)
            frames = "" if is_expected else "\n" + "".join(traceback.format_tb(exc.__traceback__))
            log.log(logging.DEBUG if is_expected else logging.WARNING, "prefix cache: no fallback fork of session "
                    "%s (%s)%s", short_id(self._source or ""), type(exc).__name__, frames)
            return
        sid = task.result().session_id
        if self._is_wanted and not self.is_draining() and self.cache.keep(sid, self.owner, is_fork=True,
                                                                           before=self._source):
            self.session_id = sid
            metrics.PREFIX_CACHE_FORKS.labels("taken").inc()
            return
        if not self._is_wanted:
            metrics.PREFIX_CACHE_FORKS.labels("discarded").inc()
        try:
            self.cache.store.close(sid, self.owner)
        except SessionNotFound:  # keep() closed it (over the byte bound)
            pass

    async def built(self) -> None:
        """Wait until the fork is built and kept (or failed)."""
        if self._task is not None and not self._task.done():
            await asyncio.wait((self._task,))

    def finish(self, is_wanted: bool) -> None:
        """The request ended: keep the fork, or close it (now, or when it is built) if it is not wanted.

        A fork still being built holds its identity's next lookups until it is kept or closed (`track_fork`):
        a wanted one may serve that turn, and an unwanted one is then gone from the pool, as it was when
        the reply's end waited for it.
        """
        if self._task is not None and not self._task.done():
            self.cache.track_fork(self.owner, self._task)
        if not is_wanted:
            self._is_wanted = False
            if self.session_id is not None and self.cache.discard(self.session_id):
                metrics.PREFIX_CACHE_FORKS.labels("discarded").inc()
