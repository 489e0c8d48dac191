"""The engine: owns the model, its probed block size, its backend and the one thread that runs all MLX compute.

The thread is the scheduler's (`scheduler.py`): appends and generations run there as jobs
batched into shared forwards, everything else as plain calls (`run`), which complete even
if the awaiting RPC is cancelled, so session state is never left half-updated. Where the
target's layers run is the backend's business (`execution/executor.py`): the local one by
default, or whatever the server hands to `use_backend` (a shard route).
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from inference_engine.model.loader import LoadedModel
from inference_engine.runtime.scheduler import Scheduler
from inference_engine.session.coordinator import SessionCoordinator
from inference_engine.session.session import Session
from inference_engine.execution.executor import Backend, LocalBackend
from inference_engine.execution.kv_cache import CacheGeometry, rollback_room
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier
from inference_engine.execution.sliding_kv_cache import session_slab_bytes
from inference_engine.execution.tile_probe import ProbeResult, probe_tile
from inference_engine.execution.token_log import TokenLog

T = TypeVar("T")
log = logging.getLogger(__name__)


def check_draft_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must share the target's vocabulary (same ids for the same tokens).

    Raises:
        ValueError: the vocabularies differ, with what differs.
    """
    if draft.spec.vocab_size != target.spec.vocab_size:
        raise ValueError(
            f"draft model {draft.spec.name!r} has vocab size {draft.spec.vocab_size}, the target "
            f"{target.spec.name!r} has {target.spec.vocab_size}: a draft model must share the tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise ValueError(f"draft model {draft.spec.name!r} uses a different tokenizer vocabulary than the target")


class Engine:
    """A loaded model, its probed block size, its backend and its compute thread.

    The draft model, if any, always runs locally.
    """

    def __init__(
        self, loaded: LoadedModel, exact: bool, max_tile: int, plain_block: int, max_rollback: int,
        draft: LoadedModel | None = None, max_batch_rows: int = 0, append_rows: int = 0,
    ):
        """
        Args:
            max_batch_rows: most rows in one batched forward (0: the block size).
            append_rows: append rows per forward while a Generate streams (0: learnt, see Scheduler).
        """
        self.loaded = loaded
        self.spec = loaded.spec
        self.max_rollback = max_rollback
        self.draft = draft
        if draft is not None:
            check_draft_compatible(loaded, draft)
        self.probe: ProbeResult | None = probe_tile(loaded.model, max_candidate=max_tile) if exact else None
        if exact and not self.probe.is_exact_possible:
            log.error("tile probe: even single rows are not repeatable on this BLAS; exact mode REFUSED, serving plain")
        self.is_exact = bool(exact and self.probe.is_exact_possible)
        self.block = self.probe.tile if self.is_exact else plain_block
        if self.is_exact:
            log.info("exact mode: block size %d (probe failures beyond it: %s)", self.block, list(self.probe.failures))
        else:
            log.warning("plain mode: block size %d; results depend on chunking", self.block)
        self.backend: Backend = LocalBackend(loaded.model, loaded.spec, self.block)
        self.draft_backend = LocalBackend(draft.model, draft.spec, self.block) if draft is not None else None
        rows = min(max_batch_rows or self.block, self.block)
        self.scheduler = Scheduler(lambda: self.backend, rows, append_rows)
        self.verify_row_cost: float | None = None  # a draft row's cost per step, if measured (verify_row_cost.py)

    def use_backend(self, backend: Backend) -> None:
        """Run the target's layers on `backend` from now on (call before serving; e.g. a shard route)."""
        self.backend = backend

    @property
    def has_draft_model(self) -> bool:
        """A draft model is loaded (SPECULATIVE_DRAFT is servable)."""
        return self.draft is not None

    def geometry(self, sink: int, window: int) -> CacheGeometry:
        """Cache geometry of a session with this sink/window on this engine."""
        return CacheGeometry(sink=sink, window=window, max_block=self.block, max_rollback=rollback_room(self.max_rollback))

    def slab_bytes(self, sink: int, window: int) -> int:
        """K/V bytes a session with this sink/window holds (wherever its layers run)."""
        return session_slab_bytes(self.geometry(sink, window), self.spec)

    def draft_slab_bytes(self, sink: int, window: int) -> int:
        """K/V bytes of a session's draft-model cache (0 without a draft model)."""
        if self.draft is None:
            return 0
        return session_slab_bytes(self.geometry(sink, window), self.draft.spec)

    def prepare_session(self, sink: int, window: int) -> object | None:
        """What opening a session may do ahead, on any thread but the engine's (see Backend.prepare)."""
        return self.backend.prepare(self.geometry(sink, window))

    def open_session(self, sink: int, window: int, tag: str = "", prepared: object | None = None) -> SessionCoordinator:
        """A new session's coordinator (allocates its KV slab, here or on the route, unless `prepared`
        by `prepare_session`). Engine thread."""
        return SessionCoordinator(self.backend, self.geometry(sink, window), tag, prepared)

    def make_verifier(self, sink: int, window: int) -> SinkWindowVerifier:
        """A standalone verifier over a fresh log (tools and tests). Engine thread."""
        log_ = TokenLog()
        return SinkWindowVerifier(self.backend.open(self.geometry(sink, window), log_), log_)

    def make_draft_cache(self, sink: int, window: int) -> SinkWindowVerifier:
        """A fresh cache over the draft model (same geometry, no token log). Engine thread."""
        assert self.draft_backend is not None
        return SinkWindowVerifier(self.draft_backend.open(self.geometry(sink, window), TokenLog()), None)

    async def run(self, fn: Callable[..., T], *args: object, session: Session | None = None) -> T:
        """Run `fn(*args)` on the engine thread (see Scheduler.run).

        Args:
            session: run once this session's running call (if any) is at a clean point.
        Raises:
            EngineUnavailable: the engine has been shut down.
        """
        return await self.scheduler.run(fn, *args, session=session)

    def close(self) -> None:
        """Stop accepting work, end running jobs and wait for the engine thread."""
        self.scheduler.close()
