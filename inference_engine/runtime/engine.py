"""The engine: owns the model and the one thread that runs all MLX compute.

asyncio code hands work to the thread through `run`; the work item runs to completion
even if the awaiting RPC is cancelled, so session state is never left half-updated.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable, TypeVar

from inference_engine.blas import active_blas
from inference_engine.errors import EngineUnavailable
from inference_engine.model.loader import LoadedModel
from inference_engine.runtime.compute_thread import ComputeThread
from inference_engine.verifier.executor import LocalExecutor
from inference_engine.verifier.kv_cache import CacheGeometry
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier
from inference_engine.verifier.tile_probe import ProbeResult, probe_tile

if TYPE_CHECKING:
    from inference_engine.shard.remote_executor import ShardRoute

T = TypeVar("T")
log = logging.getLogger(__name__)


def _verifier(loaded: LoadedModel, geometry: CacheGeometry) -> SinkWindowVerifier:
    s = loaded.spec
    return SinkWindowVerifier(LocalExecutor(loaded.model, geometry, s.num_kv_heads, s.head_dim, s.num_layers))


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


def check_route_compatible(route: ShardRoute, block: int, rollback: int, loaded: LoadedModel) -> None:
    """The route's workers must run this model and accept this engine's block and rollback.

    Raises:
        ValueError: what the route lacks and what this server needs.
    """
    from inference_engine.shard.mlx_engine import model_fingerprint

    p = route.pipeline
    head = p.capabilities[0]
    if head.model_fingerprint != model_fingerprint(loaded.model):
        raise ValueError(f"the shard route runs {head.model_name} ({head.num_layers} layers, fingerprint "
                         f"{head.model_fingerprint[:12]}); this server loaded {loaded.spec.name} "
                         f"({loaded.spec.num_layers} layers): both must run the same model")
    kernels = active_blas()
    if head.kernels != kernels:
        raise ValueError(f"the shard route computes with {head.kernels!r}, this server with {kernels!r}: "
                         "start both the same way (same BLAS, same INFERENCE_ENGINE_KERNEL) to be bitwise exact")
    if p.max_block < block or p.max_rollback < rollback:
        raise ValueError(f"the shard route accepts blocks of {p.max_block} and rollback {p.max_rollback}; this "
                         f"server needs block {block} (its probed tile) and rollback {rollback}: start the workers "
                         f"with --max-rollback >= {rollback} (and --block >= {block} or a probe that reaches it)")


class Engine:
    """A loaded model, its probed block size and its compute thread.

    With a shard route the target's layers run on the route's workers (a RemoteExecutor
    per session) at this engine's probed block, so results are bitwise the single
    process; the draft model, if any, stays local.
    """

    def __init__(
        self, loaded: LoadedModel, exact: bool, max_tile: int, plain_block: int, max_rollback: int,
        draft: LoadedModel | None = None,
    ):
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
        self.route: ShardRoute | None = None  # set by use_route: the target's layers run on shard workers
        self._thread = ComputeThread(
            "mlx-engine", lambda: EngineUnavailable("the engine is shutting down; retry against a live server")
        )

    def use_route(self, route: ShardRoute) -> None:
        """Run the target's layers on a shard route from now on (call before serving).

        Sessions then get a RemoteExecutor at this engine's probed block and geometry, so
        their results are bitwise those of this process.

        Raises:
            ValueError: the route runs another model or cannot take this block or rollback.
        """
        check_route_compatible(route, self.block, self.max_rollback + 1, self.loaded)
        self.route = route

    @property
    def has_draft_model(self) -> bool:
        """A draft model is loaded (SPECULATIVE_DRAFT is servable)."""
        return self.draft is not None

    def geometry(self, sink: int, window: int) -> CacheGeometry:
        """Cache geometry of a session with this sink/window on this engine.

        Rollback room is max_rollback + 1: a speculative step commits up to K + 1 tokens
        and a step whose tokens were never sent is retracted whole.
        """
        return CacheGeometry(sink=sink, window=window, max_block=self.block, max_rollback=self.max_rollback + 1)

    def make_verifier(self, sink: int, window: int) -> SinkWindowVerifier:
        """A fresh verifier (allocates the session's KV slab, here or on the route). Call on the engine thread."""
        if self.route is None:
            return _verifier(self.loaded, self.geometry(sink, window))
        from inference_engine.shard.remote_executor import RemoteExecutor

        g, s = self.geometry(sink, window), self.spec
        nbytes = 2 * 4 * s.num_layers * s.num_kv_heads * g.slots * s.head_dim  # K and V, fp32, as one process
        return SinkWindowVerifier(RemoteExecutor(self.route, g, nbytes))

    def make_draft_verifier(self, sink: int, window: int) -> SinkWindowVerifier:
        """A fresh cache over the draft model (same geometry). Call on the engine thread."""
        assert self.draft is not None
        return _verifier(self.draft, self.geometry(sink, window))

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the engine thread (see ComputeThread.run).

        Raises:
            EngineUnavailable: the engine has been shut down.
        """
        return await self._thread.run(fn, *args)

    def submit(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """Queue `fn(*args)` on the engine thread now (see ComputeThread.submit).

        Raises:
            EngineUnavailable: the engine has been shut down.
        """
        return self._thread.submit(fn, *args)

    def close(self) -> None:
        """Stop accepting work and wait for the running item."""
        self._thread.close()
