"""The real shard engine: transformer blocks [start, end) of an MLX model on the exact path.

The head embeds token ids, every worker runs its blocks over per-session
`SinkWindowKVCache`s, the tail applies the final norm and LM head. The compute is the front
server's own: a `LocalBackend` over this worker's span of layers, one `LocalExecutor` per
session. A lone block is chunked at the session's `max_block` (the probed tile), so a route
of these engines reproduces the single-process logits bit for bit; blocks of several
sessions waiting at once (`step_many`) share one batched forward, as the front server's
do: each weight is read once for all their rows, and each row's bits stay its session's
alone (row-invariant products, per-row attention). This file adds only what a worker
checks: its sessions' positions, inputs, cancels and broken state.

The one engine (a TEST FIXTURE wraps it to inject faults; `tests/shard_contract.py` checks both).
All calls run on the worker's engine thread but `health`, `metrics`, `capabilities` (any thread,
never blocking on running work). Cancels are the session stream's: each block asks its item
(`StepItem.is_cancelled`) before it starts and at every chunk boundary.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from inference_engine.serving_path import kernels_in_use
from inference_engine.errors import InvalidRequest, InvariantViolation, PoolExhausted, SessionNotFound
from inference_engine.model.forward import Span
from inference_engine.model.gguf_blocks import has_blocks
from inference_engine.model.loader import load_weights, model_fingerprint, spec_of
from inference_engine.shard.protocol.errors import WorkCancelled
from inference_engine.shard.protocol.types import (
    LayerRange,
    ShardCapabilities,
    ShardHealth,
    ShardMetrics,
    ShardOutput,
    ShardWork,
    StepItem,
    never_cancelled,
)
from inference_engine.execution.executor import Block, LocalBackend, LocalExecutor
from inference_engine.execution.kv_cache import CacheGeometry, SinkWindowKVCache
from inference_engine.execution.tile_probe import fp32_mismatches, probe_tile

_NUMPY_DTYPE = {mx.float32: "float32", mx.float16: "float16"}


@dataclass
class _Session:
    """One route session's caches on this engine."""

    executor: LocalExecutor  # one cache per block in [start, end), of the route's shared geometry
    broken: str = ""  # why the cache is unusable ("" = fine)

    @property
    def cache(self) -> list[SinkWindowKVCache]:
        return self.executor.cache

    @property
    def position(self) -> int:
        return self.executor.offset


class MlxShardEngine:
    """Blocks [start, end) of one MLX llama-family model, for many sessions.

    Every call naming a session raises SessionNotFound if it is not open; those naming a
    `position` (the frame's expectation) raise InvariantViolation if it is not the session's.
    """

    def __init__(
        self,
        model: nn.Module | Path,
        layers: LayerRange,
        *,
        block: int = 0,
        max_tile: int = 64,
        max_rollback: int = 8,
        max_sessions: int = 8,
        max_sink: int = 64,
        max_window: int = 8192,
        name: str | None = None,
    ):
        """
        Args:
            model: a loaded mlx-lm `Model`, or an mlx-lm folder loaded by `load`.
            layers: the blocks to run.
            block: rows per forward chunk (the tile); 0 = probe it at `load` (up to `max_tile`).
            max_rollback / max_sessions / max_sink / max_window: limits of sessions.
            name: model name reported in capabilities (default: folder name or "model").
        """
        self._source = model
        self.layers = layers
        self._block = block
        self._max_tile = max_tile
        self._limits = (max_rollback, max_sessions, max_sink, max_window)
        self._name = name or (model.name if isinstance(model, Path) else "model")
        self.model: nn.Module | None = None
        self._caps: ShardCapabilities | None = None
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()  # guards _sessions and the counters
        self._steps = self._rows = self._forwards = 0
        self._busy_s = 0.0

    # -- lifecycle -------------------------------------------------------------------

    def load(self) -> None:
        """Load weights and fix the tile; idempotent. Must precede every other call.

        Raises:
            ValueError: the layer range does not fit the model.
            InvariantViolation: no block size is bit-exact on this BLAS.
        """
        if self._caps is not None:
            return
        model = load_weights(self._source)[0] if isinstance(self._source, Path) else self._source
        args = model.args
        num_layers = int(args.num_hidden_layers)
        if self.layers.end > num_layers:
            raise ValueError(f"layer range {self.layers} exceeds the model's {num_layers} layers")
        inner = model.model
        used = [inner.embed_tokens, inner.norm, *inner.layers[self.layers.start : self.layers.end]]
        mx.eval([m.parameters() for m in used + ([model.lm_head] if hasattr(model, "lm_head") else [])])
        block, mismatches = self._block, ()
        if block <= 0:
            probe = probe_tile(model, max_candidate=self._max_tile)
            if not probe.is_exact_possible:
                raise InvariantViolation("tile probe: even single rows are not repeatable on this BLAS")
            block, mismatches = probe.tile, probe.mismatches
        elif has_blocks(model):
            mismatches = fp32_mismatches(model)  # q4_1 weights: bitwise the fp32 kernel, or refuse to serve
        if mismatches:
            raise InvariantViolation(f"the GGUF block kernel differs from the fp32 kernel ({'; '.join(mismatches)}); "
                                     "serve this worker with --weights fp32")
        act_dtype = inner.embed_tokens(mx.array([[0]], dtype=mx.int32)).dtype
        if act_dtype not in _NUMPY_DTYPE:
            raise ValueError(f"activations of dtype {act_dtype} cannot be carried between workers")
        max_rollback, max_sessions, max_sink, max_window = self._limits
        self.model = model
        self._spec = spec_of(model, self._name)
        span = Span(self.layers.start, self.layers.end, self.layers.start == 0, self.layers.end == num_layers)
        self._backend = LocalBackend(model, self._spec, block, span)
        self._caps = ShardCapabilities(
            model_name=self._name, model_fingerprint=model_fingerprint(model), num_layers=num_layers,
            layers=self.layers, hidden_size=int(args.hidden_size), vocab_size=int(args.vocab_size),
            activation_dtype=_NUMPY_DTYPE[act_dtype], max_block=block, max_rollback=max_rollback,
            max_sessions=max_sessions, max_sink=max_sink, max_window=max_window, kernels=kernels_in_use(),
        )

    def capabilities(self) -> ShardCapabilities:
        """Layer range, sizes and limits (constant after `load`; InvariantViolation before it)."""
        if self._caps is None:
            raise InvariantViolation("the shard engine is not loaded; call load() first")
        return self._caps

    # -- sessions --------------------------------------------------------------------

    def open_session(self, session_id: str, geometry: CacheGeometry) -> None:
        """Allocate a session's caches for this engine's layers, at position 0.

        Raises:
            InvalidRequest: the id is in use, or the geometry exceeds the capabilities.
            PoolExhausted: no room for another session.
        """
        caps = self.capabilities()
        checks = {
            "sink": (geometry.sink, 0, caps.max_sink),
            "window": (geometry.window, 1, caps.max_window),
            "max_block": (geometry.max_block, 1, caps.max_block),
            "max_rollback": (geometry.max_rollback, 0, caps.max_rollback),
        }
        for what, (value, low, high) in checks.items():
            if not low <= value <= high:
                raise InvalidRequest(f"session {what} = {value} is out of range; this worker allows {low}..{high}")
        executor = LocalExecutor(self._backend, geometry)
        with self._lock:
            if session_id in self._sessions:
                raise InvalidRequest(f"session {session_id!r} is already open on this worker")
            if len(self._sessions) >= caps.max_sessions:
                raise PoolExhausted(f"all {caps.max_sessions} session slots of this worker are in use")
            self._sessions[session_id] = _Session(executor)

    def release(self, session_id: str) -> bool:
        """Free the session's caches. Returns whether it existed."""
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def _session(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise SessionNotFound(f"session {session_id!r} is not open on this worker (layers {self.layers})")
        if s.broken:
            raise InvariantViolation(f"session {session_id!r} is broken ({s.broken}); release it and replay")
        return s

    # -- compute ---------------------------------------------------------------------

    def prefill(self, session_id: str, work: ShardWork,
                is_cancelled: Callable[[], bool] = never_cancelled) -> ShardOutput:
        """Compute a block of rows at the session's next positions and keep them in the cache.

        Rows run in chunks of the session's `max_block`, exactly as `forward.forward` does,
        so a route of engines reproduces the single-process result bit for bit.

        Returns:
            (rows, hidden) activations; the tail returns (rows, vocab) logits if
            `work.all_logits`, else (1, vocab) for the last row.
        Raises:
            InvalidRequest: the input does not fit this engine (tokens at the head, hidden
                of width hidden_size elsewhere, token ids below vocab_size, rows >= 1).
            InvariantViolation: `work.position` is not the session's position, or the
                session is broken (an earlier failure left its cache unusable).
            WorkCancelled: `is_cancelled()` said so, before the block or at a chunk boundary; the
                cache is as before.
        """
        return self._one(StepItem(session_id, work, False, is_cancelled))

    def decode(self, session_id: str, work: ShardWork,
               is_cancelled: Callable[[], bool] = never_cancelled) -> ShardOutput:
        """`prefill` for exactly one row (InvalidRequest for more)."""
        return self._one(StepItem(session_id, work, True, is_cancelled))

    def _one(self, item: StepItem) -> ShardOutput:
        results: list[ShardOutput | BaseException | None] = [None]
        self._run([item], [0], results)
        out = results[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def _at(self, session_id: str, position: int, what: str) -> _Session:
        """The session, which must stand at `position` for `what` (the frame's expectation)."""
        s = self._session(session_id)
        if position != s.position:
            raise InvariantViolation(f"{what} at position {position}, but the session is at {s.position}")
        return s

    def trim(self, session_id: str, n: int, position: int) -> int:
        """Drop the session's last n positions (speculative rollback); returns the new position.

        Raises:
            InvariantViolation: n exceeds max_rollback or the position.
        """
        s = self._at(session_id, position, "trim")
        allowed = min(s.executor.geometry.max_rollback, s.position)
        if not 0 <= n <= allowed:
            raise InvariantViolation(f"cannot trim {n} positions; allowed 0..{allowed}")
        s.executor.trim(n)
        return s.position

    def layer_digests(self, session_id: str, position: int) -> list[bytes]:
        """SHA-256 of each block's cached K/V (`SinkWindowKVCache.digest`), in layer order: a route's,
        head first, equal a single process's over the same tokens."""
        return self._at(session_id, position, "digest").executor.layer_digests()

    def export_kv(self, session_id: str, position: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per block, in layer order, a copy of its retained (keys, values), (n_kv, n, head_dim) each
        (`SinkWindowKVCache.canonical_state`: what `layer_digests` hashes)."""
        s = self._at(session_id, position, "K/V export")
        return [(np.array(k), np.array(v)) for k, v in (c.canonical_state() for c in s.cache)]

    def import_kv(self, session_id: str, position: int, target: int,
                  layers: list[tuple[np.ndarray, np.ndarray]]) -> int:
        """Load retained K/V (as `export_kv` returns it) into a fresh session; returns its new position `target`.

        Raises:
            InvariantViolation: the session is not at 0.
            InvalidRequest: the tensors do not fit this engine's blocks at `target` (count, shape, dtype).
        """
        s = self._at(session_id, position, "K/V import")
        if position != 0:
            raise InvariantViolation(f"K/V import at position {position}: an import loads a session just opened, at 0")
        if len(layers) != len(s.cache):
            raise InvalidRequest(f"K/V of {len(layers)} blocks for a worker running {len(s.cache)} ({self.layers})")
        try:
            for c, (k, v) in zip(s.cache, layers):
                c.load_canonical(target, k, v)
        except ValueError as exc:
            s.broken = "a K/V import failed midway"
            raise InvalidRequest(str(exc)) from None
        return s.position

    def _check_input(self, s: _Session, work: ShardWork) -> None:
        caps = self.capabilities()
        if work.position != s.position:
            raise InvariantViolation(f"block at position {work.position}, but the session is at {s.position}")
        if caps.is_head:
            if not work.tokens:
                raise InvalidRequest("the head worker needs the rows' token ids")
            bad = [t for t in work.tokens if not 0 <= t < caps.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is out of range; allowed 0..{caps.vocab_size - 1}")
            return
        h = work.hidden
        if h is None or h.ndim != 2 or h.shape[0] < 1 or h.shape[1] != caps.hidden_size:
            got = None if h is None else tuple(h.shape)
            raise InvalidRequest(f"hidden activations of shape {got}; "
                                 f"this worker needs (rows >= 1, {caps.hidden_size})")
        if h.dtype != np.dtype(caps.activation_dtype):
            raise InvalidRequest(f"hidden activations of dtype {h.dtype}; this worker needs {caps.activation_dtype}")
        if work.tokens and len(work.tokens) != h.shape[0]:
            raise InvalidRequest(f"{len(work.tokens)} sideband token ids for {h.shape[0]} rows")

    def _block_of(self, item: StepItem) -> tuple[_Session, Block]:
        """The item's block on its session's executor, once its checks pass."""
        s = self._session(item.session_id)
        work = item.work
        if item.is_decode and work.rows != 1:
            raise InvalidRequest(f"decode takes exactly one row, got {work.rows}")
        self._check_input(s, work)

        def before_chunk(done_rows: int) -> None:  # before the block, then in a lone block's chunk loop
            if item.is_cancelled():
                raise WorkCancelled(f"work {work.work_id} of session {item.session_id!r} was cancelled")

        before_chunk(0)

        tokens = tuple(work.tokens) if self._caps.is_head else ()
        return s, Block(s.executor, tokens, work.all_logits, None if self._caps.is_head else work.hidden, before_chunk)

    def step_many(self, items: Sequence[StepItem]) -> list[ShardOutput | BaseException]:
        """The blocks of several sessions, each as `decode` / `prefill` would compute it, in as few
        backend forwards as the tile allows: the first of each session that fits together (one chunk
        each) in one, the rest alone, after, in order.

        Returns:
            Per item, its output or the exception `decode` / `prefill` would have raised for it
            (one item's failure never stops the others).

        An item refused by its checks (unknown, broken or cancelled session, wrong position, bad
        input) gets its exception and stays out. A failed block's session is back where it was
        (`LocalExecutor.abandon`); a failure other than a cancel still breaks it (its worker's
        copy may disagree with the others of the route).
        """
        caps = self.capabilities()
        results: list[ShardOutput | BaseException | None] = [None] * len(items)
        together: list[int] = []
        rows, taken = 0, set()
        for i, item in enumerate(items):
            n, s = item.work.rows, self._sessions.get(item.session_id)
            fits = item.session_id not in taken and rows + n <= caps.max_block  # one chunk, as a lone block's:
            fits = fits and (s is None or n <= s.executor.geometry.max_block)  # else its chunk loop runs it alone
            taken.add(item.session_id)  # its session's later items run after it, alone
            if fits:
                together.append(i)
                rows += n
        if len(together) > 1:  # (one item alone: `prefill` / `decode`, as ever)
            self._run(items, together, results)
        alone = [i for i in range(len(items)) if i not in together or len(together) == 1]
        for i in alone:  # through `decode` / `prefill`, so that a subclass overriding them is obeyed
            try:
                item = items[i]
                results[i] = (self.decode if item.is_decode else self.prefill)(item.session_id, item.work,
                                                                                item.is_cancelled)
            except Exception as exc:  # noqa: BLE001 - that item's answer
                results[i] = exc
        return results  # type: ignore[return-value] - every slot is filled

    def _run(self, items: Sequence[StepItem], group: list[int], results: list) -> None:
        """One backend forward of the items `group` (by index) that pass their checks."""
        started, blocks = time.perf_counter(), []
        for i in group:
            try:
                blocks.append((i, *self._block_of(items[i])))
            except Exception as exc:  # noqa: BLE001 - that item's answer
                results[i] = exc
        if not blocks:
            return
        positions = [s.position for _, s, _ in blocks]
        outs = self._backend.forward([b for _, _, b in blocks])
        for (i, s, block), position, out in zip(blocks, positions, outs):
            results[i] = self._output(items[i], s, block, position, out)
        lone = blocks[0][2]  # a lone block runs in chunks of its session's max_block
        self._count(len(blocks), sum(b.rows for _, _, b in blocks), started,
                    chunks=-(-lone.rows // lone.executor.geometry.max_block) if len(blocks) == 1 else 1)

    def _output(self, item: StepItem, s: _Session, block: Block, position: int,
                out: mx.array | BaseException) -> ShardOutput | BaseException:
        if isinstance(out, WorkCancelled) and s.executor.is_broken:
            s.broken = f"cancelled after more rows than max_block + max_rollback ({block.rows})"
            return InvariantViolation(f"block of {block.rows} rows cancelled midway; the session cannot be "
                                      f"restored: {s.broken}")
        if isinstance(out, BaseException):
            if not isinstance(out, (WorkCancelled, InvariantViolation)):
                s.broken = f"compute failed at position {position}: {type(out).__name__}"
            return out
        return ShardOutput(item.work.work_id, position, s.position, np.array(out))

    def _count(self, steps: int, rows: int, started: float, chunks: int = 1) -> None:
        with self._lock:
            self._steps += steps
            self._rows += rows
            self._forwards += chunks
            self._busy_s += time.perf_counter() - started

    # -- observability ---------------------------------------------------------------

    def health(self) -> ShardHealth:
        """Whether work is accepted (cheap, thread-safe)."""
        n = len(self._sessions)
        if self._caps is None:
            return ShardHealth(False, "not loaded", n)
        return ShardHealth(True, f"layers {self.layers} of {self._caps.model_name}, block {self._caps.max_block}", n)

    def metrics(self) -> ShardMetrics:
        """Counters since start (thread-safe)."""
        with self._lock:
            kv = sum(c.nbytes for s in self._sessions.values() for c in s.cache)
            return ShardMetrics(len(self._sessions), kv, self._steps, self._rows, self._busy_s, self._forwards)
