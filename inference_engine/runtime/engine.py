"""The engine: owns the model and the one thread that runs all MLX compute.

asyncio code hands work to the thread through `run`; the work item runs to completion
even if the awaiting RPC is cancelled, so session state is never left half-updated.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from inference_engine.errors import EngineUnavailable
from inference_engine.model.loader import LoadedModel
from inference_engine.verifier.kv_cache import CacheGeometry
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier
from inference_engine.verifier.tile_probe import ProbeResult, probe_tile

T = TypeVar("T")
log = logging.getLogger(__name__)


class Engine:
    """A loaded model, its probed block size and its compute thread."""

    def __init__(self, loaded: LoadedModel, exact: bool, max_tile: int, plain_block: int, max_rollback: int):
        self.loaded = loaded
        self.spec = loaded.spec
        self.max_rollback = max_rollback
        self.probe: ProbeResult | None = probe_tile(loaded.model, max_candidate=max_tile) if exact else None
        if exact and not self.probe.is_exact_possible:
            log.error("tile probe: even single rows are not repeatable on this BLAS; exact mode REFUSED, serving plain")
        self.is_exact = bool(exact and self.probe.is_exact_possible)
        self.block = self.probe.tile if self.is_exact else plain_block
        if self.is_exact:
            log.info("exact mode: block size %d (probe failures beyond it: %s)", self.block, list(self.probe.failures))
        else:
            log.warning("plain mode: block size %d; results depend on chunking", self.block)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-engine")
        self._closed = False

    def geometry(self, sink: int, window: int) -> CacheGeometry:
        """Cache geometry of a session with this sink/window on this engine."""
        return CacheGeometry(sink=sink, window=window, max_block=self.block, max_rollback=self.max_rollback)

    def make_verifier(self, sink: int, window: int) -> SinkWindowVerifier:
        """A fresh verifier (allocates the session's KV slab). Call on the engine thread."""
        s = self.spec
        return SinkWindowVerifier(self.loaded.model, self.geometry(sink, window), s.num_kv_heads, s.head_dim, s.num_layers)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the engine thread and return its result.

        If the caller is cancelled, the work still completes before the cancellation
        propagates, so callers can rely on state being consistent afterwards.

        Raises:
            EngineUnavailable: the engine has been shut down.
        """
        if self._closed:
            raise EngineUnavailable("the engine is shutting down; retry against a live server")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    def close(self) -> None:
        """Stop accepting work and wait for the running item."""
        self._closed = True
        self._pool.shutdown(wait=True)
