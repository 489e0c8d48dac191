"""Where a session's layers run and its K/V lives: backends and their per-session executors.

A `Backend` is chosen once per server: `LocalBackend` runs the whole model in this process,
`shard.client.route_backend.RouteBackend` runs it on a route of shard workers. It opens one
`Executor` per session (that session's K/V, wherever it lives) and forwards the blocks of
many sessions at once (`forward`): locally as one batched forward whose matmuls read each
weight once for all rows; on a route as concurrent per-session calls. The verifier, the
coordinator and the scheduler never know which backend they have.

A shard worker runs the same `LocalBackend` over its span of layers [a, b) (`Span`): token
ids in at the head, hidden states in elsewhere, logits out at the tail, hidden states
elsewhere. One batched forward and one undo (`abandon`) serve both processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from inference_engine.errors import InvariantViolation
from inference_engine.model.forward import Segment, Span, forward, forward_rows
from inference_engine.model.loader import ModelSpec
from inference_engine.execution.kv_cache import CacheGeometry, CanonicalKV, SinkWindowKVCache
from inference_engine.execution.sliding_kv_cache import layer_cache, layer_storage
from inference_engine.execution.token_log import TokenLog


class Executor(ABC):
    """One session's K/V, computed by its backend."""

    geometry: CacheGeometry  # the session's cache geometry (identical wherever it runs)
    backend: "Backend"  # what computes its blocks

    @property
    @abstractmethod
    def offset(self) -> int:
        """Positions computed into the K/V, including a block not yet committed."""

    @abstractmethod
    def trim(self, n: int) -> None:
        """Drop the last `n` positions (0 <= n <= min(max_rollback, offset)). Never half-applied."""

    @abstractmethod
    def layer_digests(self) -> list[bytes]:
        """SHA-256 of each layer's canonical K/V, in layer order (see SinkWindowKVCache.digest)."""

    @abstractmethod
    def canonical_kv(self) -> CanonicalKV:
        """A copy of the retained K/V of every layer in position order (a session snapshot; no block pending).

        Equal for equal digests, wherever the layers run (here or on a route's workers).
        """

    @abstractmethod
    def load_canonical_kv(self, kv: CanonicalKV) -> None:
        """Load `kv` into this fresh executor (offset 0), which then stands at `kv.position`.

        Raises:
            InvariantViolation: the executor is not fresh, or `kv` does not fit its geometry and model.
            RuntimeServiceError: a route could not take it (the executor should then be closed).
        """

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of K/V storage the session holds, wherever it lives (fixed by the geometry)."""

    @abstractmethod
    def close(self) -> None:
        """Free the session's K/V (here or on the workers). Idempotent; the executor is unusable after."""

    @property
    def is_broken(self) -> bool:
        """A failed block left the K/V undefined: the session must be rebuilt from its log."""
        return False

    def snapshot(self) -> object | None:
        """An opaque copy of the K/V to `restore` later, or None if this executor cannot take one."""
        return None

    def restore(self, snapshot: object) -> None:
        """Return the K/V exactly to `snapshot` (taken by this executor, no block pending)."""
        raise NotImplementedError

    def forward(self, tokens: Sequence[int], all_logits: bool, wait: bool = True) -> mx.array:
        """This session's block alone (see Backend.forward).

        Raises:
            RuntimeServiceError or any compute error: the block could not be computed.
        """
        out = self.backend.forward([Block(self, tuple(tokens), all_logits)], wait)[0]
        if isinstance(out, BaseException):
            raise out
        return out


@dataclass(frozen=True)
class Block:
    """One session's rows in a backend forward."""

    executor: Executor  # the session's K/V (advanced by `rows`)
    tokens: tuple[int, ...]  # the rows' token ids, at positions executor.offset.. (a span that embeds)
    all_logits: bool  # logits of every row (verification), else of the last row only
    hidden: np.ndarray | None = None  # (rows, hidden) input of a span that does not embed (a shard worker's)
    before_chunk: Callable[[int], None] | None = None  # a lone block's check before each chunk (rows done); may raise to stop

    @property
    def rows(self) -> int:
        """Rows of the block (its positions in the K/V)."""
        return len(self.tokens) if self.hidden is None else int(self.hidden.shape[0])


class Backend(ABC):
    """Computes the blocks of many sessions; opens their executors."""

    max_block: int  # most rows in one forward chunk (the probed tile)

    def prepare(self, geometry: CacheGeometry) -> object | None:
        """The part of `open` that may run on any thread, before it (None: nothing to do ahead).

        The local backend allocates the session's zeroed K/V here: on the engine thread those
        ~48 MB of page faults and copying took ~40 ms, a hole in every running stream.
        """
        return None

    @abstractmethod
    def open(self, geometry: CacheGeometry, log: TokenLog, prepared: object | None = None) -> Executor:
        """A new session's executor at position 0.

        Args:
            geometry: its cache geometry (max_block = this backend's).
            log: the session's token log (a route replays a prefix of it after a failure).
            prepared: what `prepare(geometry)` returned, if it ran.
        Raises:
            RuntimeServiceError: no room (PoolExhausted), a refused geometry or an unreachable route.
        """

    @abstractmethod
    def forward(self, blocks: Sequence[Block], wait: bool = True) -> list[mx.array | BaseException]:
        """Compute every block at its session's next positions, pending the verifiers' commits.

        With one block it may be any length (chunked at `max_block`); with several, their
        rows together must not exceed `max_block`. Bits of a block never depend on the others.

        Args:
            wait: False lets the results be returned while they are still computing (reading
                them waits); a backend may ignore it.
        Returns:
            Per block, (L, V) float32 logits (or (1, V) for the last row only), or the
            exception that stopped that block. A failed block's executor is back at its
            position before the block, exactly (or `is_broken`, and the caller rebuilds it).
        """

    def close(self) -> None:
        """Release what the backend holds (connections, threads). Idempotent."""


class LocalExecutor(Executor):
    """A session's K/V in this process: one SinkWindowKVCache per layer."""

    def __init__(self, backend: "LocalBackend", geometry: CacheGeometry,
                 storage: list[tuple[mx.array, mx.array]] | None = None):
        """
        Args:
            storage: each layer's zeroed K/V (`LocalBackend.prepare`), else allocated here.
        """
        self.backend = backend
        self.geometry = geometry
        s, span = backend.spec, backend.span
        self.cache: list[SinkWindowKVCache] = [  # a sliding-window layer's bounded by the model's window
            layer_cache(geometry, s, i, storage[i - span.start] if storage else None) for i in range(span.start, span.end)
        ]
        self._is_broken = False

    @property
    def is_broken(self) -> bool:
        return self._is_broken

    def abandon(self, start: int, rows: int) -> None:
        """Forget a block that failed midway: back to `start`, or broken if that is not exact.

        Rows written at positions start.. only overwrote ring slots of positions no query at
        `start` reads, as long as the block fits the ring's slack (max_block + max_rollback).
        """
        g = self.geometry  # every layer's ring has this slack, sliding ones included
        if rows <= g.max_block + g.max_rollback:
            for c in self.cache:
                c.offset = start
        else:
            self._is_broken = True

    @property
    def offset(self) -> int:
        return self.cache[0].offset

    def trim(self, n: int) -> None:
        for c in self.cache:
            c.trim(n)

    def layer_digests(self) -> list[bytes]:
        return [c.digest() for c in self.cache]

    def canonical_kv(self) -> CanonicalKV:
        keys, values = zip(*(c.canonical_state() for c in self.cache))
        return CanonicalKV(self.offset, np.array(mx.stack(keys)), np.array(mx.stack(values)))  # (L, n_kv, n, D)

    def load_canonical_kv(self, kv: CanonicalKV) -> None:
        if len(kv.keys) != len(self.cache) or len(kv.values) != len(self.cache):
            raise InvariantViolation(f"canonical K/V of {len(kv.keys)} layers for a model of {len(self.cache)}")
        try:
            for c, k, v in zip(self.cache, kv.keys, kv.values):
                c.load_canonical(kv.position, k, v)
        except ValueError as exc:
            raise InvariantViolation(str(exc)) from None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache)

    def close(self) -> None:
        self.cache = []  # the arrays go with their last reference

    def snapshot(self) -> object:
        # A copy of every layer's storage, taken now: the native attention kernel writes
        # into the caches' buffers in place (a slab copy per layer, once per deep checkpoint),
        # after the writes already queued have landed.
        mx.synchronize()
        return [(mx.array(np.array(c.keys)), mx.array(np.array(c.values)), c.offset) for c in self.cache]

    def restore(self, snapshot: object) -> None:
        for c, (keys, values, offset) in zip(self.cache, snapshot):
            c.keys, c.values, c.offset = keys, values, offset
        self._is_broken = False


class LocalBackend(Backend):
    """The model's layers [span.start, span.end) in this process; many sessions' rows share one forward."""

    def __init__(self, model: nn.Module, spec: ModelSpec, max_block: int, span: Span | None = None):
        """
        Args:
            span: the layers to run (default the whole model: token ids in, logits out).
        """
        self.model = model
        self.spec = spec
        self.max_block = max_block
        self.span = span or Span.whole(model)

    def prepare(self, geometry: CacheGeometry) -> list[tuple[mx.array, mx.array]]:
        return layer_storage(geometry, self.spec)[self.span.start : self.span.end]

    def open(self, geometry: CacheGeometry, log: TokenLog, prepared: object | None = None) -> Executor:
        return LocalExecutor(self, geometry, prepared)  # type: ignore[arg-type] - what prepare returned

    def forward(self, blocks: Sequence[Block], wait: bool = True) -> list[mx.array | BaseException]:
        starts = [b.executor.offset for b in blocks]
        try:
            if len(blocks) == 1:
                b = blocks[0]
                x = b.tokens if b.hidden is None else b.hidden
                return [forward(self.model, x, b.executor.cache, b.all_logits, wait, self.span, b.before_chunk)]
            return self._forward_together(blocks, wait)
        except Exception as exc:  # the batch failed as a whole: every session in it goes back
            for b, start in zip(blocks, starts):
                b.executor.abandon(start, b.rows)
            return [exc] * len(blocks)

    def _forward_together(self, blocks: Sequence[Block], wait: bool) -> list[mx.array]:
        rows = sum(b.rows for b in blocks)
        if rows > self.max_block:
            raise ValueError(f"a batched forward of {rows} rows exceeds the block size {self.max_block}")
        segments = [Segment(b.executor.cache, b.rows, b.all_logits) for b in blocks]
        if self.span.embeds:
            x = mx.array([t for b in blocks for t in b.tokens], dtype=mx.int32)  # (R,)
        else:
            x = mx.array(np.concatenate([b.hidden for b in blocks]))[None]  # (1, R, hidden)
        out = forward_rows(self.model, x, segments, self.span)  # (N, V) logits, or (1, R, hidden)
        state = (out, [c.state for b in blocks for c in b.executor.cache])
        mx.eval(*state) if wait else mx.async_eval(*state)
        if not self.span.has_lm_head:
            out = out[0]  # (R, hidden)
        outs, lo = [], 0
        for b in blocks:
            n = b.rows if b.all_logits or not self.span.has_lm_head else 1
            outs.append(out[lo : lo + n])
            lo += n
        return outs
